// The CPU stager and the choice of stager. See Note [Host tier schedule] in device_stager.h.
#include "offload/device_stager.h"

#include <ATen/ATen.h>

#include "fsdp/errors.h"

namespace fsdp::offload {
namespace {

// On CPU runs host memory is the compute device's memory: the copies are synchronous clones,
// kept (rather than skipped) so that CPU tests run the host tier's schedule.
class CpuStager : public DeviceStager {
 public:
  at::Tensor host_zeros(int64_t numel) override { return at::zeros({numel}, at::kFloat); }
  at::Tensor to_device(const at::Tensor& host) override {
    count(host.nbytes(), 0);
    return host.clone();
  }
  at::Tensor to_host(const at::Tensor& device) override {
    count(0, device.nbytes());
    return device.clone();
  }
  void copy_to_device(const at::Tensor& dst, const at::Tensor& host) override {
    count(host.nbytes(), 0);
    dst.copy_(host);
  }
  const char* name() const override { return "cpu"; }
};

}  // namespace

std::shared_ptr<DeviceStager> make_stager(const c10::Device& compute) {
  if (compute.is_cpu()) return std::make_shared<CpuStager>();
  if (compute.is_cuda()) return make_cuda_stager(compute);
  throw ConfigError("fsdp: offload tier \"host\" does not support parameters on " + compute.str());
}

}  // namespace fsdp::offload
