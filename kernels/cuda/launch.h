// Host launchers of the CUDA kernels (kernels/cuda/*.cu), on raw device pointers whose arguments
// kernels/ops.cpp has already checked. Each enqueues exactly one kernel on `stream` and returns
// the launch's cudaError_t (flashinfer style); kernels/cuda/ops_cuda.cpp turns a failure into an
// fsdp::Error. Only CUDA's runtime API header is included, to keep nvcc's work small.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

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

}  // namespace fsdp::kernels::cuda
