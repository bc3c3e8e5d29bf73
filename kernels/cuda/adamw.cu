// Fused AdamW over a flat fp32 shard (contract: fused_adamw in kernels/ops.h): one pass reads
// param, grad, exp_avg, exp_avg_sq, writes the first three back and optionally the param's
// bf16/fp16/fp32 copy for the next all-gather. One launch per call.
//
// Compiled with --fmad=false (kernels/CMakeLists.txt) so that the only fused multiply-adds are the
// explicit fmaf of ATen's lerp; with IEEE sqrt and division this is the CPU twin's arithmetic
// operation for operation (Note [Twin numerics] in kernels/ops.cpp).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace fsdp::kernels::cuda {
namespace {

__device__ __forceinline__ void adamw_element(const AdamWScalars& s, float& p, float g, float& m, float& v) {
  if (s.apply_decay) p = p * s.decay;
  m = s.lerp_small ? fmaf(s.lerp_coeff, g - m, m) : fmaf(s.lerp_coeff, g - m, g);
  v = v * s.beta2;
  v = v + s.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / s.sqrt_bc2 + s.eps;
  p = p + s.step_size * m / denom;
}

template <typename CopyT>
__global__ void adamw_kernel(AdamWScalars s, float* __restrict__ param, const float* __restrict__ grad,
                             float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, CopyT* __restrict__ copy,
                             int64_t n, Split split) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = tid; k < split.nvec; k += stride) {
    const int64_t i = split.head + 4 * k;
    auto p = *reinterpret_cast<const Pack4<float>*>(param + i);
    const auto g = *reinterpret_cast<const Pack4<float>*>(grad + i);
    auto m = *reinterpret_cast<const Pack4<float>*>(exp_avg + i);
    auto v = *reinterpret_cast<const Pack4<float>*>(exp_avg_sq + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) adamw_element(s, p.v[j], g.v[j], m.v[j], v.v[j]);
    *reinterpret_cast<Pack4<float>*>(param + i) = p;
    *reinterpret_cast<Pack4<float>*>(exp_avg + i) = m;
    *reinterpret_cast<Pack4<float>*>(exp_avg_sq + i) = v;
    if (copy != nullptr) {
      Pack4<CopyT> c;
#pragma unroll
      for (int j = 0; j < 4; ++j) c.v[j] = from_float<CopyT>(p.v[j]);
      *reinterpret_cast<Pack4<CopyT>*>(copy + i) = c;
    }
  }
  const int64_t scalar_count = n - 4 * split.nvec;
  for (int64_t k = tid; k < scalar_count; k += stride) {
    const int64_t i = scalar_index(k, split);
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_element(s, p, grad[i], m, v);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (copy != nullptr) copy[i] = from_float<CopyT>(p);
  }
}

template <typename CopyT>
cudaError_t launch(const AdamWScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   CopyT* copy, int64_t n, cudaStream_t stream) {
  int offsets[5] = {pack_offset(param, 4), pack_offset(grad, 4), pack_offset(exp_avg, 4), pack_offset(exp_avg_sq, 4),
                    copy ? pack_offset(copy, sizeof(CopyT)) : pack_offset(param, 4)};
  const Split split = split_for(n, offsets, 5);
  const unsigned blocks = grid_for(split.nvec + (n - 4 * split.nvec));
  adamw_kernel<CopyT><<<blocks, kThreads, 0, stream>>>(s, param, grad, exp_avg, exp_avg_sq, copy, n, split);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_adamw(const AdamWScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                         void* param_copy, ElemType copy_type, int64_t n, cudaStream_t stream) {
  if (param_copy == nullptr) {
    return launch<float>(s, param, grad, exp_avg, exp_avg_sq, nullptr, n, stream);
  }
  switch (copy_type) {
    case ElemType::kFloat32:
      return launch(s, param, grad, exp_avg, exp_avg_sq, static_cast<float*>(param_copy), n, stream);
    case ElemType::kBFloat16:
      return launch(s, param, grad, exp_avg, exp_avg_sq, static_cast<__nv_bfloat16*>(param_copy), n, stream);
    case ElemType::kFloat16:
      return launch(s, param, grad, exp_avg, exp_avg_sq, static_cast<__half*>(param_copy), n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fsdp::kernels::cuda
