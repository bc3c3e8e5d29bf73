// Host launchers of the CUDA kernels (kernels/cuda/*.cu), on raw device pointers whose arguments
// kernels/ops.cpp has already checked. Each enqueues exactly one kernel on `stream` and returns
// the launch's cudaError_t (flashinfer style); kernels/cuda/ops_cuda.cpp turns a failure into an
// fsdp::Error. Only CUDA's runtime API header is included, to keep nvcc's work small.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/block_format.h"
#include "kernels/kernel_args.h"

namespace fsdp::kernels::cuda {

cudaError_t launch_adamw(const AdamWScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                         void* param_copy, ElemType copy_type, int64_t n, cudaStream_t stream);
cudaError_t launch_copy_in(const void* src, ElemType src_type, void* dst, ElemType dst_type, int64_t n, int64_t dst_n,
                           float divide_by, cudaStream_t stream);
cudaError_t launch_copy_out(const void* src, ElemType src_type, float* dst, int64_t n, float divide_by, bool accumulate,
                            cudaStream_t stream);
// Adds the sum of squares of x to *out (device memory).
cudaError_t launch_sum_of_squares(const float* x, int64_t n, double* out, cudaStream_t stream);
cudaError_t launch_scale(float* x, int64_t n, float factor, cudaStream_t stream);
// The block codec (kernels/cuda/blocks.cu: compiled, untested on a GPU). absmax points at
// blocks * 4 bytes of fp32, at any byte alignment.
cudaError_t launch_encode_blocks(BlockFormat f, const NF4Table& t, const void* values, ElemType type, int64_t blocks,
                                 uint8_t* codes, uint8_t* absmax, cudaStream_t stream);
cudaError_t launch_decode_blocks(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax,
                                 int64_t blocks, void* out, ElemType type, cudaStream_t stream);

}  // namespace fsdp::kernels::cuda
