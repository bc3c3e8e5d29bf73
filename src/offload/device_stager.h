// The host tier's copies between host memory and the compute device, behind one interface
// (backends, not #ifdefs): the CPU stager used on CPU runs, and the CUDA stager
// (cuda_stager.cpp, CUDA builds only) with pinned host memory, a side stream and events.
//
// Note [Host tier schedule]
// A unit whose params are in the host tier keeps its fp32 master shard in host memory. Before
// its all-gather the shard (cast to the compute dtype) is copied to the device on the side
// stream; the compute stream waits on that copy's event, not the host, and the all-gather reads
// the device copy. After the reduce-scatter the reduced gradient shard is copied back on the side
// stream and added into the host gradient shard; the optimizer then steps the host master, its
// state in host memory, on the CPU (step_shard, with at::get_num_threads() threads). On CPU runs
// the "device" is host memory: the copies are plain synchronous copies, so the schedule is the
// same code path and its results are checked bit for bit against no offload.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace fsdp::offload {

class DeviceStager {
 public:
  virtual ~DeviceStager() = default;
  // Zero-filled fp32 host memory for host-tier states (pinned with CUDA).
  virtual at::Tensor host_zeros(int64_t numel) = 0;
  // A device copy of `host`, safe to use on the compute stream when this returns (the stream
  // waits on the copy's event; the host does not).
  virtual at::Tensor to_device(const at::Tensor& host) = 0;
  // A host copy of `device`, complete when this returns (the copy runs on the side stream after
  // the compute stream's pending work).
  virtual at::Tensor to_host(const at::Tensor& device) = 0;
  // Copies host values into an existing device tensor `dst` (same numel and dtype), through
  // pinned staging; the compute stream is ordered after the copy, the host need not wait.
  virtual void copy_to_device(const at::Tensor& dst, const at::Tensor& host) = 0;
  // Bytes copied to and from the device so far (the I/O a memory plan predicts).
  int64_t bytes_to_device() const { return to_device_bytes_; }
  int64_t bytes_to_host() const { return to_host_bytes_; }

 protected:
  void count(int64_t to_device, int64_t to_host) {
    to_device_bytes_ += to_device;
    to_host_bytes_ += to_host;
  }

 private:
  std::atomic<int64_t> to_device_bytes_{0}, to_host_bytes_{0};

 public:
  virtual const char* name() const = 0;
};

// The stager for parameters on `compute`: CPU, or CUDA in CUDA builds (else a ConfigError).
std::shared_ptr<DeviceStager> make_stager(const c10::Device& compute);
// In CUDA builds, the CUDA stager; throws ConfigError in CPU-only builds (cuda_stager.cpp or
// cuda_stager_unavailable.cpp).
std::shared_ptr<DeviceStager> make_cuda_stager(const c10::Device& device);

}  // namespace fsdp::offload
