// See self_group.h.
#include "comm/self_group.h"

#include "comm/transport.h"

namespace fsdp {

std::shared_ptr<Communicator> make_self_group(const std::string& name, int global_rank,
                                              std::chrono::milliseconds timeout) {
  CommunicatorOptions copts;
  copts.name = name;
  copts.timeout = timeout;
  copts.global_ranks = {global_rank};
  return std::make_shared<Communicator>(make_local_transport(), copts);
}

}  // namespace fsdp
