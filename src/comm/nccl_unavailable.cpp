// The CPU-only build's answer to a request for NCCL: a clear error, never a silent fallback.
#include "comm/transport.h"

namespace fsdp {

std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                               std::chrono::milliseconds) {
  throw ConfigError(
      "fsdp: InitOptions::device(\"cuda\") needs NCCL, but this build has no CUDA parts "
      "(configured with FSDP_WITH_CUDA=OFF or without nvcc); rebuild with -DFSDP_WITH_CUDA=ON");
}

}  // namespace fsdp
