// CPU twins of the sharded-step kernels (contracts in kernels/ops.h): fused AdamW, the
// mixed-precision copy-in and copy-out, the partial sum of squares and the clip scale. Vectorized
// with at::vec::Vectorized and split across threads with at::parallel_for above kGrainSize.
//
// Note [Two builds of the twins]
// This file is compiled twice (kernels/CMakeLists.txt): with CPU_CAPABILITY=DEFAULT for any x86-64,
// and with CPU_CAPABILITY=AVX2 plus -mavx2 -mfma, the way ATen builds its own CPU kernels. The
// CPU_CAPABILITY macro names the inline namespace of at::vec, so the two builds' Vectorized types
// and our functions do not collide. Both builds use -ffp-contract=off: the only fused multiply-adds
// are the explicit at::vec::fmadd calls, placed where ATen's kernels place them (lerp), so the AVX2
// twin reproduces ATen's AVX2/AVX-512 results element for element, and the twins' results do not
// depend on the thread count.
#include "kernels/cpu/twins.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace fsdp::kernels::cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Elements handled per inner block: the float staging buffers of the casts live on the stack
// and stay in L1.
constexpr int64_t kBlock = 512;

// Widening a 16-bit float is exact; at::vec::load_to_float does a vector of them at a time
// (at::vec::convert has no vectorized bf16/fp16 -> float path).
template <typename T>
void widen(const T* src, float* out, int64_t len) {
  int64_t j = 0;
  for (; j + kVec <= len; j += kVec) {
    Vec v;
    at::vec::load_to_float(src + j, v);
    v.store(out + j);
  }
  for (; j < len; ++j) out[j] = static_cast<float>(src[j]);
}

// One element type's block <-> float conversions; narrowing uses at::vec::convert's vectorized
// round-to-nearest-even paths.
void to_float(const void* src, ElemType t, int64_t i, float* out, int64_t len) {
  switch (t) {
    case ElemType::kFloat32: std::memcpy(out, static_cast<const float*>(src) + i, len * sizeof(float)); return;
    case ElemType::kBFloat16: widen(static_cast<const c10::BFloat16*>(src) + i, out, len); return;
    case ElemType::kFloat16: widen(static_cast<const c10::Half*>(src) + i, out, len); return;
  }
}

void from_float(const float* in, void* dst, ElemType t, int64_t i, int64_t len) {
  switch (t) {
    case ElemType::kFloat32: std::memcpy(static_cast<float*>(dst) + i, in, len * sizeof(float)); return;
    case ElemType::kBFloat16: at::vec::convert(in, static_cast<c10::BFloat16*>(dst) + i, len); return;
    case ElemType::kFloat16: at::vec::convert(in, static_cast<c10::Half*>(dst) + i, len); return;
  }
}

void divide_block(float* x, int64_t len, float divide_by) {
  const Vec d(divide_by);
  for (int64_t j = 0; j < len; j += kVec) {
    const int64_t c = std::min(kVec, len - j);
    (Vec::loadu(x + j, c) / d).store(x + j, static_cast<int>(c));
  }
}

}  // namespace

void adamw(const AdamWScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* param_copy,
           ElemType copy_type, int64_t n) {
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    const Vec decay(s.decay), coeff(s.lerp_coeff), beta2(s.beta2), one_minus_beta2(s.one_minus_beta2),
        sqrt_bc2(s.sqrt_bc2), eps(s.eps), step_size(s.step_size);
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t block_end = std::min(end, b + kBlock);
      for (int64_t i = b; i < block_end; i += kVec) {
        // The tail of a block is one partial vector, so it runs the same instructions.
        const int c = static_cast<int>(std::min(kVec, block_end - i));
        Vec p = Vec::loadu(param + i, c);
        const Vec g = Vec::loadu(grad + i, c);
        Vec m = Vec::loadu(exp_avg + i, c);
        Vec v = Vec::loadu(exp_avg_sq + i, c);
        if (s.apply_decay) p = p * decay;                   // p.mul_(1 - lr*wd)
        m = s.lerp_small ? at::vec::fmadd(coeff, g - m, m)  // m.lerp_(g, 1 - b1)
                         : at::vec::fmadd(coeff, g - m, g);
        v = v * beta2;                                // v.mul_(b2)
        v = v + one_minus_beta2 * g * g;              // .addcmul_(g, g, 1 - b2)
        const Vec denom = v.sqrt() / sqrt_bc2 + eps;  // v.sqrt() / sqrt(bc2) + eps
        p = p + step_size * m / denom;                // p.addcdiv_(m, denom, -lr/bc1)
        p.store(param + i, c);
        m.store(exp_avg + i, c);
        v.store(exp_avg_sq + i, c);
      }
      if (param_copy != nullptr) from_float(param + b, param_copy, copy_type, b, block_end - b);
    }
  });
}

void copy_in(const void* src, ElemType src_type, void* dst, ElemType dst_type, int64_t n, int64_t dst_n,
             float divide_by) {
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    float buf[kBlock];
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t len = std::min(end, b + kBlock) - b;
      if (src_type == dst_type && divide_by == 1.0f) {
        std::memcpy(static_cast<char*>(dst) + b * elem_size(dst_type),
                    static_cast<const char*>(src) + b * elem_size(src_type), len * elem_size(dst_type));
        continue;
      }
      const float* widened = buf;
      if (src_type == ElemType::kFloat32 && divide_by == 1.0f) {
        widened = static_cast<const float*>(src) + b;  // narrow straight from the source
      } else {
        to_float(src, src_type, b, buf, len);
        if (divide_by != 1.0f) divide_block(buf, len, divide_by);
      }
      from_float(widened, dst, dst_type, b, len);
    }
  });
  if (dst_n > n) std::memset(static_cast<char*>(dst) + n * elem_size(dst_type), 0, (dst_n - n) * elem_size(dst_type));
}

void copy_out(const void* src, ElemType src_type, float* dst, int64_t n, float divide_by, bool accumulate) {
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    float buf[kBlock];
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t len = std::min(end, b + kBlock) - b;
      if (accumulate) {
        to_float(src, src_type, b, buf, len);
        if (divide_by != 1.0f) divide_block(buf, len, divide_by);
        for (int64_t j = 0; j < len; j += kVec) {
          const int c = static_cast<int>(std::min(kVec, len - j));
          (Vec::loadu(dst + b + j, c) + Vec::loadu(buf + j, c)).store(dst + b + j, c);
        }
        continue;
      }
      // In place (src is dst, fp32) there is nothing to convert, only the division.
      const bool in_place = src_type == ElemType::kFloat32 && static_cast<const float*>(src) == dst;
      if (!in_place) to_float(src, src_type, b, dst + b, len);
      if (divide_by != 1.0f) divide_block(dst + b, len, divide_by);
    }
  });
}

double sum_of_squares(const float* x, int64_t n) {
  // Fixed blocks summed in a fixed order: the result does not depend on the thread count.
  const int64_t blocks = (n + kGrainSize - 1) / kGrainSize;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* p = x + b * kGrainSize;
      const int64_t len = std::min(kGrainSize, n - b * kGrainSize);
      // Eight independent double lanes: the compiler vectorizes them without reassociating.
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= len; i += 8) {
        for (int k = 0; k < 8; ++k) {
          const double d = p[i + k];
          acc[k] += d * d;
        }
      }
      for (; i < len; ++i) {
        const double d = p[i];
        acc[0] += d * d;
      }
      partial[static_cast<size_t>(b)] =
          ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void scale(float* x, int64_t n, float factor) {
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    const Vec f(factor);
    for (int64_t i = begin; i < end; i += kVec) {
      const int c = static_cast<int>(std::min(kVec, end - i));
      (Vec::loadu(x + i, c) * f).store(x + i, c);
    }
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fsdp::kernels::cpu
