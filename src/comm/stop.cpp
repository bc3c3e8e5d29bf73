// StopRequest and the cross-rank agreement on it (fsdp/stop.h).
#include "fsdp/stop.h"

#include <ATen/ATen.h>

#include <atomic>

namespace fsdp {
namespace {

// Lock-free on every platform fsdp builds for (checked below): a signal handler may touch them.
std::atomic<int> first_signal{0};
std::atomic<int> requests{0};
static_assert(std::atomic<int>::is_always_lock_free, "StopRequest must be async-signal-safe");

}  // namespace

int StopRequest::record(int sig) noexcept {
  int expected = 0;
  first_signal.compare_exchange_strong(expected, sig);
  return requests.fetch_add(1) + 1;
}

int StopRequest::signal() noexcept { return first_signal.load(); }

void StopRequest::reset() noexcept {
  first_signal.store(0);
  requests.store(0);
}

int agree_on_stop(Communicator& comm, int local_signal, const std::string& tag) {
  // A double holds any signal number exactly; host tensors, whatever the transport.
  at::Tensor mine = at::full({1}, static_cast<double>(local_signal), at::kDouble);
  at::Tensor all = at::empty({comm.size()}, at::kDouble);
  comm.all_gather(all, mine, tag).wait();
  const double* v = all.data_ptr<double>();
  for (int r = 0; r < comm.size(); ++r) {
    if (v[r] != 0) return static_cast<int>(v[r]);
  }
  return 0;
}

}  // namespace fsdp
