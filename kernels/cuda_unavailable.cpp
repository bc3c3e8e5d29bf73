// The CPU-only build's answer to a CUDA tensor reaching a kernel: a clear error. Such a tensor
// cannot normally exist there (the build links LibTorch's CPU libraries only); no silent fallback.
#include "fsdp/errors.h"
#include "kernels/device_ops.h"

namespace fsdp::kernels::cuda {
namespace {

[[noreturn]] void unavailable(const char* op, const at::Tensor& t) {
  throw Error(std::string("fsdp::kernels::") + op + ": got a tensor on " + t.device().str() +
              ", but this build has no CUDA kernels (configured with FSDP_WITH_CUDA=OFF or without nvcc); "
              "rebuild with -DFSDP_WITH_CUDA=ON");
}

}  // namespace

bool built() { return false; }
void adamw(const AdamWScalars&, const at::Tensor& param, const at::Tensor&, const at::Tensor&, const at::Tensor&,
           const at::Tensor&) {
  unavailable("fused_adamw", param);
}
void copy_in(const at::Tensor& src, const at::Tensor&, float) { unavailable("copy_in", src); }
void copy_out(const at::Tensor& src, const at::Tensor&, float, bool) { unavailable("copy_out", src); }
void sum_of_squares(const at::Tensor& x, const at::Tensor&) { unavailable("sum_of_squares", x); }
void scale(const at::Tensor& x, float) { unavailable("scale_", x); }
void encode_blocks(BlockFormat, const NF4Table&, const at::Tensor& values, const at::Tensor&) {
  unavailable("encode_blocks", values);
}
void decode_blocks(BlockFormat, const NF4Table&, const at::Tensor& stored, const at::Tensor&) {
  unavailable("decode_blocks", stored);
}

}  // namespace fsdp::kernels::cuda
