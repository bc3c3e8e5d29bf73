// ATen-facing wrappers of the CUDA launchers (CUDA builds only): take checked tensors, make their
// device current, launch on its current stream, and turn a failed launch into an fsdp::Error that
// names the kernel. Kept apart from the .cu files so nvcc never parses ATen's CUDA headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>

#include "fsdp/errors.h"
#include "kernels/cuda/launch.h"
#include "kernels/device_ops.h"

namespace fsdp::kernels::cuda {
namespace {

ElemType elem_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return ElemType::kBFloat16;
    case at::kHalf: return ElemType::kFloat16;
    default: return ElemType::kFloat32;  // ops.cpp allows nothing else
  }
}

void check_launch(cudaError_t err, const char* kernel, int64_t n) {
  if (err != cudaSuccess) {
    throw Error(std::string("fsdp::kernels: CUDA launch of ") + kernel + " on " + std::to_string(n) +
                " elements failed: " + cudaGetErrorString(err));
  }
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

}  // namespace

bool built() { return true; }

void adamw(const AdamWScalars& s, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const at::Tensor& param_copy) {
  c10::cuda::CUDAGuard guard(param.device());
  const bool has_copy = param_copy.defined();
  check_launch(launch_adamw(s, param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                            exp_avg_sq.data_ptr<float>(), has_copy ? param_copy.data_ptr() : nullptr,
                            has_copy ? elem_type(param_copy) : ElemType::kFloat32, param.numel(), stream_of(param)),
               "adamw_kernel", param.numel());
}

void copy_in(const at::Tensor& src, const at::Tensor& dst, float divide_by) {
  c10::cuda::CUDAGuard guard(src.device());
  check_launch(launch_copy_in(src.data_ptr(), elem_type(src), dst.data_ptr(), elem_type(dst), src.numel(), dst.numel(),
                              divide_by, stream_of(src)),
               "copy_in_kernel", dst.numel());
}

void copy_out(const at::Tensor& src, const at::Tensor& dst, float divide_by, bool accumulate) {
  c10::cuda::CUDAGuard guard(src.device());
  check_launch(launch_copy_out(src.data_ptr(), elem_type(src), dst.data_ptr<float>(), src.numel(), divide_by,
                               accumulate, stream_of(src)),
               "copy_out_kernel", src.numel());
}

void sum_of_squares(const at::Tensor& x, const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(x.device());
  check_launch(launch_sum_of_squares(x.data_ptr<float>(), x.numel(), out.data_ptr<double>(), stream_of(x)),
               "sum_of_squares_kernel", x.numel());
}

void scale(const at::Tensor& x, float factor) {
  c10::cuda::CUDAGuard guard(x.device());
  check_launch(launch_scale(x.data_ptr<float>(), x.numel(), factor, stream_of(x)), "scale_kernel", x.numel());
}

void encode_blocks(BlockFormat f, const NF4Table& t, const at::Tensor& values, const at::Tensor& stored) {
  c10::cuda::CUDAGuard guard(values.device());
  auto* bytes = stored.data_ptr<uint8_t>();
  check_launch(launch_encode_blocks(f, t, values.data_ptr(), elem_type(values), values.numel() / kQuantBlock, bytes,
                                    bytes + block_code_bytes(f, values.numel()), stream_of(values)),
               "encode_blocks_kernel", values.numel());
}

void decode_blocks(BlockFormat f, const NF4Table& t, const at::Tensor& stored, const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(stored.device());
  const auto* bytes = stored.data_ptr<uint8_t>();
  check_launch(launch_decode_blocks(f, t, bytes, bytes + block_code_bytes(f, out.numel()), out.numel() / kQuantBlock,
                                    out.data_ptr(), elem_type(out), stream_of(stored)),
               "decode_blocks_kernel", out.numel());
}

}  // namespace fsdp::kernels::cuda
