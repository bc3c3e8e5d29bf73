// The CUDA stager (CUDA builds only): host-tier states in pinned host memory, copies on a side
// stream ordered against the compute stream with events. See Note [Host tier schedule].
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "tiers/device_stager.h"

namespace fsdp::offload {
namespace {

class CudaStager : public DeviceStager {
 public:
  explicit CudaStager(const c10::Device& device)
      : device_(device), side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  at::Tensor host_zeros(int64_t numel) override {
    return at::zeros({numel}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
  }

  at::Tensor to_device(const at::Tensor& host) override {
    c10::cuda::CUDAGuard guard(device_);
    auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
    at::Tensor out;
    at::cuda::CUDAEvent copied;
    {
      c10::cuda::CUDAStreamGuard on_side(side_);
      out = at::empty(host.sizes(), host.options().device(device_).pinned_memory(false));
      out.copy_(host, /*non_blocking=*/true);
      copied.record(side_);
    }
    // The all-gather on the compute stream must not read the shard before the copy lands; an
    // event wait keeps the host free to issue the next unit's work.
    copied.block(compute);
    // `out` was allocated on the side stream and is used on the compute stream: tell the caching
    // allocator, or it could hand the memory out again while the compute stream still reads it.
    out.record_stream(compute);
    return out;
  }

  at::Tensor to_host(const at::Tensor& device) override {
    c10::cuda::CUDAGuard guard(device_);
    auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
    // The reduced gradient is produced on the compute stream: the side stream waits for it there.
    at::cuda::CUDAEvent produced;
    produced.record(compute);
    produced.block(side_);
    at::Tensor out = at::empty(device.sizes(), device.options().device(at::kCPU).pinned_memory(true));
    at::cuda::CUDAEvent copied;
    {
      c10::cuda::CUDAStreamGuard on_side(side_);
      out.copy_(device, /*non_blocking=*/true);
      copied.record(side_);
    }
    device.record_stream(side_);
    // The CPU optimizer reads `out` next: it must have landed. Only this copy is waited for.
    copied.synchronize();
    return out;
  }

  const char* name() const override { return "cuda"; }

 private:
  c10::Device device_;
  c10::cuda::CUDAStream side_;
};

}  // namespace

std::shared_ptr<DeviceStager> make_cuda_stager(const c10::Device& device) {
  return std::make_shared<CudaStager>(device);
}

}  // namespace fsdp::offload
