// The block codec on the GPU (contracts: encode_blocks and decode_blocks in kernels/ops.h; the
// format: Note [Frozen storage] in kernels/cpu/blocks.cpp). Compiled, untested on a GPU: written
// to do the CPU twins' IEEE fp32 operations in the same order (nvcc's default IEEE division,
// --fmad=false like adamw.cu), and held to the twins by KernelBlocksCuda.* in
// tests/unit/kernels_blocks_test.cpp, which skips without a GPU and has not run on one yet.
// One launch per call: encode gives each block of 64 values to one warp (two values a lane, the
// absmax by a warp shuffle); decode gives each value to one thread.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kWarp = 32;
static_assert(kQuantBlock == 2 * kWarp, "encode_blocks_kernel gives each lane two values of a block");

// The absmax at any byte alignment: one float access when aligned, four byte accesses otherwise.
__device__ __forceinline__ float load_absmax(const uint8_t* absmax, int64_t b, bool aligned) {
  if (aligned) return reinterpret_cast<const float*>(absmax)[b];
  unsigned bits = 0;
  for (int k = 0; k < 4; ++k) bits |= static_cast<unsigned>(absmax[4 * b + k]) << (8 * k);
  return __uint_as_float(bits);
}

__device__ __forceinline__ void store_absmax(uint8_t* absmax, int64_t b, float am, bool aligned) {
  if (aligned) {
    reinterpret_cast<float*>(absmax)[b] = am;
    return;
  }
  const unsigned bits = __float_as_uint(am);
  for (int k = 0; k < 4; ++k) absmax[4 * b + k] = static_cast<uint8_t>(bits >> (8 * k));
}

// max that propagates NaN, like at::amax.
__device__ __forceinline__ float nan_max(float a, float b) { return isnan(a) ? a : isnan(b) ? b : fmaxf(a, b); }

__device__ __forceinline__ uint8_t int8_code(float unit) {
  const float r = rintf(unit * 127.0f);  // round half to even
  return static_cast<uint8_t>(static_cast<int8_t>(r >= -127.0f && r <= 127.0f ? static_cast<int>(r) : 0));
}

__device__ __forceinline__ unsigned nf4_code(float s, const NF4Table& t) {
  if (!isnan(s)) s = fminf(fmaxf(s, -1.0f), 1.0f);  // NaN stays NaN (and counts every midpoint)
  unsigned q = 0;
#pragma unroll
  for (int j = 0; j < 15; ++j) q += !(t.mids[j] >= s);
  return q;
}

template <typename T>
__global__ void encode_blocks_kernel(BlockFormat f, NF4Table t, const T* __restrict__ values, int64_t blocks,
                                     uint8_t* __restrict__ codes, uint8_t* __restrict__ absmax, bool aligned) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  for (int64_t b = warp; b < blocks; b += warps) {  // the same trip count for a whole warp
    const T* x = values + b * kQuantBlock + 2 * lane;
    const float x0 = to_float(x[0]), x1 = to_float(x[1]);
    float am = nan_max(fabsf(x0), fabsf(x1));
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) am = nan_max(am, __shfl_xor_sync(0xffffffffu, am, o));
    if (f == BlockFormat::kInt8) {
      const float d = am > 0.0f ? am : 1.0f;
      codes[b * kQuantBlock + 2 * lane] = int8_code(x0 / d);
      codes[b * kQuantBlock + 2 * lane + 1] = int8_code(x1 / d);
    } else {
      const float inv = 1.0f / (isnan(am) ? am : fmaxf(am, 1e-38f));
      codes[b * (kQuantBlock / 2) + lane] = static_cast<uint8_t>((nf4_code(x0 * inv, t) << 4) | nf4_code(x1 * inv, t));
    }
    if (lane == 0) store_absmax(absmax, b, am, aligned);
  }
}

template <typename T>
__global__ void decode_blocks_kernel(BlockFormat f, NF4Table t, const uint8_t* __restrict__ codes,
                                     const uint8_t* __restrict__ absmax, int64_t n, T* __restrict__ out, bool aligned) {
  __shared__ float levels[16];
  if (threadIdx.x < 16) levels[threadIdx.x] = t.levels[threadIdx.x];
  __syncthreads();
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < n; i += stride) {
    const float am = load_absmax(absmax, i / kQuantBlock, aligned);
    float v;
    if (f == BlockFormat::kInt8) {
      v = (static_cast<float>(static_cast<int8_t>(codes[i])) / 127.0f) * am;
    } else {
      const unsigned c = codes[i / 2];
      v = levels[(i & 1) ? (c & 15u) : (c >> 4)] * am;
    }
    out[i] = from_float<T>(v);
  }
}

bool aligned4(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

template <typename T>
cudaError_t encode_typed(BlockFormat f, const NF4Table& t, const void* values, int64_t blocks, uint8_t* codes,
                         uint8_t* absmax, cudaStream_t stream) {
  encode_blocks_kernel<T><<<grid_for(blocks * kWarp), kThreads, 0, stream>>>(f, t, static_cast<const T*>(values),
                                                                             blocks, codes, absmax, aligned4(absmax));
  return cudaGetLastError();
}

template <typename T>
cudaError_t decode_typed(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax, int64_t blocks,
                         void* out, cudaStream_t stream) {
  const int64_t n = blocks * kQuantBlock;
  decode_blocks_kernel<T>
      <<<grid_for(n), kThreads, 0, stream>>>(f, t, codes, absmax, n, static_cast<T*>(out), aligned4(absmax));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_encode_blocks(BlockFormat f, const NF4Table& t, const void* values, ElemType type, int64_t blocks,
                                 uint8_t* codes, uint8_t* absmax, cudaStream_t stream) {
  switch (type) {
    case ElemType::kFloat32: return encode_typed<float>(f, t, values, blocks, codes, absmax, stream);
    case ElemType::kBFloat16: return encode_typed<__nv_bfloat16>(f, t, values, blocks, codes, absmax, stream);
    case ElemType::kFloat16: return encode_typed<__half>(f, t, values, blocks, codes, absmax, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_decode_blocks(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax,
                                 int64_t blocks, void* out, ElemType type, cudaStream_t stream) {
  switch (type) {
    case ElemType::kFloat32: return decode_typed<float>(f, t, codes, absmax, blocks, out, stream);
    case ElemType::kBFloat16: return decode_typed<__nv_bfloat16>(f, t, codes, absmax, blocks, out, stream);
    case ElemType::kFloat16: return decode_typed<__half>(f, t, codes, absmax, blocks, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fsdp::kernels::cuda
