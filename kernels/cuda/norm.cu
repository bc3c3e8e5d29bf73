// Gradient clipping by global norm (contracts: sum_of_squares and scale_ in kernels/ops.h): a
// partial sum of squares accumulated in double, and the scale in place. One launch each; four
// elements per load where aligned (Note [Vector body, scalar head and tail] in common.cuh).
// Compiled with --fmad=false, so a product is rounded before it is added, as in the CPU twin.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace fsdp::kernels::cuda {
namespace {

__device__ __forceinline__ double square(float x) {
  const double d = x;
  return d * d;
}

// Each block reduces its elements in double (warp shuffles, then one value per warp in shared
// memory) and adds the block's sum to *out atomically: one launch, no scratch buffer; the order of
// the atomic adds changes only the last bits of the double.
__global__ void sum_of_squares_kernel(const float* __restrict__ x, int64_t n, Split split, double* out) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double acc = 0;
  for (int64_t k = tid; k < split.nvec; k += stride) {
    const auto in = *reinterpret_cast<const Pack4<float>*>(x + split.head + 4 * k);
    acc += (square(in.v[0]) + square(in.v[1])) + (square(in.v[2]) + square(in.v[3]));
  }
  const int64_t scalar_count = n - 4 * split.nvec;
  for (int64_t k = tid; k < scalar_count; k += stride) acc += square(x[scalar_index(k, split)]);
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  __shared__ double warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (lane == 0) atomicAdd(out, acc);
  }
}

__global__ void scale_kernel(float* __restrict__ x, int64_t n, float factor, Split split) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = tid; k < split.nvec; k += stride) {
    auto* p = reinterpret_cast<Pack4<float>*>(x + split.head + 4 * k);
    auto v = *p;
#pragma unroll
    for (int j = 0; j < 4; ++j) v.v[j] = v.v[j] * factor;
    *p = v;
  }
  const int64_t scalar_count = n - 4 * split.nvec;
  for (int64_t k = tid; k < scalar_count; k += stride) {
    const int64_t i = scalar_index(k, split);
    x[i] = x[i] * factor;
  }
}

}  // namespace

cudaError_t launch_sum_of_squares(const float* x, int64_t n, double* out, cudaStream_t stream) {
  const int offsets[1] = {pack_offset(x, 4)};
  const Split split = split_for(n, offsets, 1);
  sum_of_squares_kernel<<<grid_for(split.nvec + (n - 4 * split.nvec)), kThreads, 0, stream>>>(x, n, split, out);
  return cudaGetLastError();
}

cudaError_t launch_scale(float* x, int64_t n, float factor, cudaStream_t stream) {
  const int offsets[1] = {pack_offset(x, 4)};
  const Split split = split_for(n, offsets, 1);
  scale_kernel<<<grid_for(split.nvec + (n - 4 * split.nvec)), kThreads, 0, stream>>>(x, n, factor, split);
  return cudaGetLastError();
}

}  // namespace fsdp::kernels::cuda
