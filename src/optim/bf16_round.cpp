// See bf16_round.h.
#include "optim/bf16_round.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>

#include "fsdp/errors.h"

namespace fsdp {
namespace {

// A 32-bit integer hash (two multiply-xorshift rounds). Its multipliers are below 2^31, so the ATen
// path computes it exactly in int64 arithmetic (each product stays below 2^63).
constexpr uint32_t kMul1 = 0x7feb352dU, kMul2 = 0x68e31da5U;

inline uint32_t mix(uint32_t h) {
  h ^= h >> 16;
  h *= kMul1;
  h ^= h >> 15;
  h *= kMul2;
  h ^= h >> 16;
  return h;
}

constexpr uint32_t kExponent = 0x7f800000U, kMantissa = 0x007fffffU;

void check_args(const at::Tensor& src, const at::Tensor& dst) {
  if (!src.defined() || !dst.defined() || src.scalar_type() != at::kFloat || dst.scalar_type() != at::kBFloat16 ||
      !src.is_contiguous() || !dst.is_contiguous() || src.numel() != dst.numel() || src.device() != dst.device()) {
    throw Error("fsdp: round_to_bf16_stochastic takes contiguous fp32 src and bf16 dst of one numel on one device");
  }
}

}  // namespace

uint32_t bf16_round_seed(size_t flat_index, int64_t step, int slot) {
  // splitmix64's finalizer over the three, folded to 32 bits.
  uint64_t z = static_cast<uint64_t>(flat_index) * 0x9e3779b97f4a7c15ULL ^
               static_cast<uint64_t>(step) * 0xbf58476d1ce4e5b9ULL ^
               static_cast<uint64_t>(slot + 1) * 0x94d049bb133111ebULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<uint32_t>(z ^ (z >> 32));
}

uint32_t bf16_round_bits(uint32_t seed, int64_t index) { return mix(static_cast<uint32_t>(index) + seed) & 0xffffU; }

void round_to_bf16_stochastic(const at::Tensor& src, const at::Tensor& dst, uint32_t seed, int64_t first) {
  check_args(src, dst);
  if (!src.is_cpu()) return testing::round_to_bf16_stochastic_ops(src, dst, seed, first);
  const float* in = src.data_ptr<float>();
  auto* out = static_cast<uint16_t*>(dst.data_ptr());
  at::parallel_for(0, src.numel(), 1 << 15, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      uint32_t x;
      std::memcpy(&x, in + i, sizeof x);
      if ((x & kExponent) == kExponent) {  // infinity stays, NaN keeps a mantissa bit
        out[i] = static_cast<uint16_t>((x >> 16) | ((x & kMantissa) != 0 ? 0x40U : 0U));
      } else {
        out[i] = static_cast<uint16_t>((x + bf16_round_bits(seed, first + i)) >> 16);
      }
    }
  });
}

namespace testing {

void round_to_bf16_stochastic_ops(const at::Tensor& src, const at::Tensor& dst, uint32_t seed, int64_t first) {
  check_args(src, dst);
  const int64_t kLow32 = 0xffffffffLL;
  const auto longs = at::TensorOptions().dtype(at::kLong).device(src.device());
  at::Tensor h = at::bitwise_and(at::arange(first, first + src.numel(), longs) + static_cast<int64_t>(seed), kLow32);
  h = at::bitwise_xor(h, at::bitwise_right_shift(h, 16));
  h = at::bitwise_and(h * static_cast<int64_t>(kMul1), kLow32);
  h = at::bitwise_xor(h, at::bitwise_right_shift(h, 15));
  h = at::bitwise_and(h * static_cast<int64_t>(kMul2), kLow32);
  h = at::bitwise_xor(h, at::bitwise_right_shift(h, 16));
  const at::Tensor r = at::bitwise_and(h, 0xffff);
  const at::Tensor x = at::bitwise_and(src.view(at::kInt).to(at::kLong), kLow32);
  const at::Tensor special = at::bitwise_and(x, static_cast<int64_t>(kExponent)) == static_cast<int64_t>(kExponent);
  const at::Tensor nan = at::logical_and(special, at::bitwise_and(x, static_cast<int64_t>(kMantissa)) != 0);
  const at::Tensor kept = at::bitwise_or(at::bitwise_right_shift(x, 16), nan.to(at::kLong) * 0x40);
  at::Tensor out = at::where(special, kept, at::bitwise_right_shift(x + r, 16));
  out = out - (out >= 32768).to(at::kLong) * 65536;  // the bf16 bit pattern as a signed 16-bit integer
  dst.copy_(out.to(at::kShort).view(at::kBFloat16));
}

}  // namespace testing
}  // namespace fsdp
