// The per-device halves of kernels/ops.h, called by kernels/ops.cpp after it has checked the
// arguments: fsdp::kernels::cuda in kernels/cuda/ops_cuda.cpp (CUDA builds) or
// kernels/cuda_unavailable.cpp (CPU-only builds, where every entry throws). The CPU twins are in
// kernels/cpu/twins.h.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/block_format.h"
#include "kernels/kernel_args.h"

namespace fsdp::kernels::cuda {

bool built();
void adamw(const AdamWScalars& s, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const at::Tensor& param_copy);
void copy_in(const at::Tensor& src, const at::Tensor& dst, float divide_by);
void copy_out(const at::Tensor& src, const at::Tensor& dst, float divide_by, bool accumulate);
void sum_of_squares(const at::Tensor& x, const at::Tensor& out);
void scale(const at::Tensor& x, float factor);
void encode_blocks(BlockFormat f, const NF4Table& t, const at::Tensor& values, const at::Tensor& stored);
void decode_blocks(BlockFormat f, const NF4Table& t, const at::Tensor& stored, const at::Tensor& out);

}  // namespace fsdp::kernels::cuda
