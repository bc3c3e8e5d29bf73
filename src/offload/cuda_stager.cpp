// The CUDA stager (CUDA builds only): host-tier states in pinned host memory, copies on a side
// stream ordered against the compute stream with events. See Note [Host tier schedule].
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <deque>
#include <memory>
#include <mutex>
#include <utility>

#include "offload/device_stager.h"

namespace fsdp::offload {
namespace {

class CudaStager : public DeviceStager {
 public:
  explicit CudaStager(const c10::Device& device)
      : device_(device), side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  at::Tensor host_zeros(int64_t numel) override {
    return at::zeros({numel}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
  }

  at::Tensor to_device(const at::Tensor& host_in) override {
    c10::cuda::CUDAGuard guard(device_);
    auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
    const at::Tensor host = pinned(host_in);
    count(host.nbytes(), 0);
    at::Tensor out;
    at::cuda::CUDAEvent copied;
    {
      c10::cuda::CUDAStreamGuard on_side(side_);
      out = at::empty(host.sizes(), host.options().device(device_).pinned_memory(false));
      out.copy_(host, /*non_blocking=*/true);
      copied.record(side_);
      keep_until_copied(host, copied);
    }
    // The all-gather on the compute stream must not read the shard before the copy lands; an
    // event wait keeps the host free to issue the next unit's work.
    copied.block(compute);
    // `out` was allocated on the side stream and is used on the compute stream: tell the caching
    // allocator, or it could hand the memory out again while the compute stream still reads it.
    out.record_stream(compute);
    return out;
  }

  void copy_to_device(const at::Tensor& dst, const at::Tensor& host_in) override {
    c10::cuda::CUDAGuard guard(device_);
    auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
    const at::Tensor host = pinned(host_in);
    count(host.nbytes(), 0);
    // dst may still be read by an all-gather queued on the compute stream: the side stream waits.
    at::cuda::CUDAEvent free_to_write;
    free_to_write.record(compute);
    free_to_write.block(side_);
    at::cuda::CUDAEvent copied;
    {
      c10::cuda::CUDAStreamGuard on_side(side_);
      dst.copy_(host, /*non_blocking=*/true);
      copied.record(side_);
      keep_until_copied(host, copied);
    }
    copied.block(compute);
  }

  at::Tensor to_host(const at::Tensor& device) override {
    count(0, device.nbytes());
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
  // Every host copy to the device goes through pinned memory: pageable memory (a disk-tier read
  // buffer, a CPU-computed cast) is staged into a pinned buffer first, so the copy is a DMA that
  // overlaps compute.
  at::Tensor pinned(const at::Tensor& host) {
    if (host.is_pinned()) return host;
    at::Tensor staged = at::empty(host.sizes(), host.options().pinned_memory(true));
    staged.copy_(host);
    return staged;
  }

  // A pinned source must stay alive until its asynchronous copy has run: kept here until the
  // copy's event has completed (checked on every later copy). The optimizer's thread copies too
  // (ShardedOptimizer::step_in_backward), hence the lock.
  void keep_until_copied(const at::Tensor& host, at::cuda::CUDAEvent& copied) {
    std::lock_guard<std::mutex> lock(in_flight_mu_);
    while (!in_flight_.empty() && in_flight_.front().first->query()) in_flight_.pop_front();
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    done->record(side_);
    in_flight_.emplace_back(std::move(done), host);
    (void)copied;
  }

  c10::Device device_;
  c10::cuda::CUDAStream side_;
  std::mutex in_flight_mu_;
  std::deque<std::pair<std::shared_ptr<at::cuda::CUDAEvent>, at::Tensor>> in_flight_;
};

}  // namespace

std::shared_ptr<DeviceStager> make_cuda_stager(const c10::Device& device) {
  return std::make_shared<CudaStager>(device);
}

}  // namespace fsdp::offload
