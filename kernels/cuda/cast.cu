// The mixed-precision casts around the collectives (contracts: copy_in and copy_out in
// kernels/ops.h): copy-in of a shard into the all-gather's dtype with zeroed padding, and
// copy-out of a reduced gradient into the fp32 gradient shard, each with its divide factor.
// One launch per call; four elements per load where the arrays' offsets agree (Note [Vector
// body, scalar head and tail] in common.cuh). Compiled with --fmad=false like adamw.cu.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace fsdp::kernels::cuda {
namespace {

template <typename SrcT, typename DstT>
__global__ void copy_in_kernel(const SrcT* __restrict__ src, DstT* __restrict__ dst, int64_t n, int64_t dst_n,
                               float divide_by, bool divide, Split split) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = tid; k < split.nvec; k += stride) {
    const int64_t i = split.head + 4 * k;
    const auto in = *reinterpret_cast<const Pack4<SrcT>*>(src + i);
    Pack4<DstT> out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = to_float(in.v[j]);
      out.v[j] = from_float<DstT>(divide ? x / divide_by : x);
    }
    *reinterpret_cast<Pack4<DstT>*>(dst + i) = out;
  }
  const int64_t scalar_count = n - 4 * split.nvec;
  for (int64_t k = tid; k < scalar_count; k += stride) {
    const int64_t i = scalar_index(k, split);
    const float x = to_float(src[i]);
    dst[i] = from_float<DstT>(divide ? x / divide_by : x);
  }
  for (int64_t k = n + tid; k < dst_n; k += stride) dst[k] = from_float<DstT>(0.0f);  // padding
}

template <typename SrcT>
__global__ void copy_out_kernel(const SrcT* src, float* dst, int64_t n, float divide_by, bool divide, bool accumulate,
                                Split split) {
  // No __restrict__: src may be dst (in place, fp32, without accumulate).
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = tid; k < split.nvec; k += stride) {
    const int64_t i = split.head + 4 * k;
    const auto in = *reinterpret_cast<const Pack4<SrcT>*>(src + i);
    Pack4<float> out;
    if (accumulate) out = *reinterpret_cast<const Pack4<float>*>(dst + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float x = to_float(in.v[j]);
      if (divide) x = x / divide_by;
      out.v[j] = accumulate ? out.v[j] + x : x;
    }
    *reinterpret_cast<Pack4<float>*>(dst + i) = out;
  }
  const int64_t scalar_count = n - 4 * split.nvec;
  for (int64_t k = tid; k < scalar_count; k += stride) {
    const int64_t i = scalar_index(k, split);
    float x = to_float(src[i]);
    if (divide) x = x / divide_by;
    dst[i] = accumulate ? dst[i] + x : x;
  }
}

template <typename SrcT, typename DstT>
cudaError_t copy_in_typed(const void* src, void* dst, int64_t n, int64_t dst_n, float divide_by, cudaStream_t stream) {
  const auto* s = static_cast<const SrcT*>(src);
  auto* d = static_cast<DstT*>(dst);
  const int offsets[2] = {pack_offset(s, sizeof(SrcT)), pack_offset(d, sizeof(DstT))};
  const Split split = split_for(n, offsets, 2);
  const int64_t work = split.nvec + (n - 4 * split.nvec);
  const unsigned blocks = grid_for(work > dst_n - n ? work : dst_n - n);
  copy_in_kernel<SrcT, DstT><<<blocks, kThreads, 0, stream>>>(s, d, n, dst_n, divide_by, divide_by != 1.0f, split);
  return cudaGetLastError();
}

template <typename SrcT>
cudaError_t copy_in_to(const void* src, void* dst, ElemType dst_type, int64_t n, int64_t dst_n, float divide_by,
                       cudaStream_t stream) {
  switch (dst_type) {
    case ElemType::kFloat32: return copy_in_typed<SrcT, float>(src, dst, n, dst_n, divide_by, stream);
    case ElemType::kBFloat16: return copy_in_typed<SrcT, __nv_bfloat16>(src, dst, n, dst_n, divide_by, stream);
    case ElemType::kFloat16: return copy_in_typed<SrcT, __half>(src, dst, n, dst_n, divide_by, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename SrcT>
cudaError_t copy_out_typed(const void* src, float* dst, int64_t n, float divide_by, bool accumulate,
                           cudaStream_t stream) {
  const auto* s = static_cast<const SrcT*>(src);
  const int offsets[2] = {pack_offset(s, sizeof(SrcT)), pack_offset(dst, 4)};
  const Split split = split_for(n, offsets, 2);
  const unsigned blocks = grid_for(split.nvec + (n - 4 * split.nvec));
  copy_out_kernel<SrcT><<<blocks, kThreads, 0, stream>>>(s, dst, n, divide_by, divide_by != 1.0f, accumulate, split);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_copy_in(const void* src, ElemType src_type, void* dst, ElemType dst_type, int64_t n, int64_t dst_n,
                           float divide_by, cudaStream_t stream) {
  switch (src_type) {
    case ElemType::kFloat32: return copy_in_to<float>(src, dst, dst_type, n, dst_n, divide_by, stream);
    case ElemType::kBFloat16: return copy_in_to<__nv_bfloat16>(src, dst, dst_type, n, dst_n, divide_by, stream);
    case ElemType::kFloat16: return copy_in_to<__half>(src, dst, dst_type, n, dst_n, divide_by, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_out(const void* src, ElemType src_type, float* dst, int64_t n, float divide_by, bool accumulate,
                            cudaStream_t stream) {
  switch (src_type) {
    case ElemType::kFloat32: return copy_out_typed<float>(src, dst, n, divide_by, accumulate, stream);
    case ElemType::kBFloat16: return copy_out_typed<__nv_bfloat16>(src, dst, n, divide_by, accumulate, stream);
    case ElemType::kFloat16: return copy_out_typed<__half>(src, dst, n, divide_by, accumulate, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fsdp::kernels::cuda
