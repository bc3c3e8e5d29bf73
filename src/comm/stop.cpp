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
  return agree_on_stop_with(comm, local_signal, {}, tag).signal;
}

StopAgreement agree_on_stop_with(Communicator& comm, int local_signal, const std::vector<double>& values,
                                 const std::string& tag) {
  // A double holds any signal number exactly; host tensors, whatever the transport. Each rank's
  // slot: its signal, then its values.
  const int64_t slot = 1 + static_cast<int64_t>(values.size());
  at::Tensor mine = at::empty({slot}, at::kDouble);
  double* m = mine.data_ptr<double>();
  m[0] = static_cast<double>(local_signal);
  for (size_t i = 0; i < values.size(); ++i) m[1 + i] = values[i];
  at::Tensor all = at::empty({comm.size() * slot}, at::kDouble);
  comm.all_gather(all, mine, tag).wait();
  const double* v = all.data_ptr<double>();
  StopAgreement out;
  out.values.resize(static_cast<size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    const double* s = v + r * slot;
    if (out.signal == 0 && s[0] != 0) out.signal = static_cast<int>(s[0]);
    out.values[static_cast<size_t>(r)].assign(s + 1, s + slot);
  }
  return out;
}

}  // namespace fsdp
