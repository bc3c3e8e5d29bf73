// Helpers shared by the .cu files: grid sizing, packs of four elements for vectorized loads, and
// element conversions that round as at::Tensor::to does.
//
// Note [Vector body, scalar head and tail]
// A kernel moves four elements per load (16 bytes of fp32, 8 of bf16/fp16) when every array it
// touches sits at the same offset modulo four elements; then elements [0, head) and the last
// n - head - 4*nvec are done one by one, by the same launch. Views at any offset (chunks of a
// shard) are therefore fine; arrays at different offsets take the all-scalar path (head = n).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_args.h"

namespace fsdp::kernels::cuda {

constexpr int kThreads = 256;

template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Offset of p modulo four elements of size `size`, or -1 when p is not even element-aligned.
inline int pack_offset(const void* p, int size) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a % size != 0) return -1;
  return static_cast<int>((a / size) % 4);
}

// The [0, head) / 4-wide body / tail split of Note [Vector body, scalar head and tail], given each
// array's pack_offset (all must agree).
struct Split {
  int64_t head = 0;
  int64_t nvec = 0;
};
inline Split split_for(int64_t n, const int* offsets, int count) {
  Split s;
  for (int i = 0; i < count; ++i) {
    if (offsets[i] < 0 || offsets[i] != offsets[0]) {
      s.head = n;  // all scalar
      return s;
    }
  }
  s.head = (4 - offsets[0]) % 4;
  if (s.head > n) s.head = n;
  s.nvec = (n - s.head) / 4;
  return s;
}

// Blocks for `work` items: enough to fill the device, never more than the work needs.
inline unsigned grid_for(int64_t work) {
  int device = 0, sms = 108;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  int64_t blocks = (work + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}

// Index of the k-th element done one by one: the head first, then the tail.
__device__ __forceinline__ int64_t scalar_index(int64_t k, const Split& s) {
  return k < s.head ? k : s.head + 4 * s.nvec + (k - s.head);
}

}  // namespace fsdp::kernels::cuda
