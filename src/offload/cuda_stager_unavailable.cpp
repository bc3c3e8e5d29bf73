// CPU-only builds: the CUDA stager does not exist; asking for it is an error that says so.
#include "fsdp/errors.h"
#include "offload/device_stager.h"

namespace fsdp::offload {

std::shared_ptr<DeviceStager> make_cuda_stager(const c10::Device& device) {
  throw ConfigError("fsdp: offload tier \"host\" for parameters on " + device.str() +
                    " needs a CUDA build of fsdp (configure with FSDP_WITH_CUDA=ON)");
}

}  // namespace fsdp::offload
