// Stopping a job cleanly when it is asked to (a scheduler's SIGTERM before its SIGKILL, a user's
// Ctrl-C): a request recorded from a signal handler, and the agreement that makes every rank stop
// after the same step, whether it received the signal or not.
//
//   install handlers that call fsdp::StopRequest::record(sig)            (the program's choice)
//   after each step: if (int sig = fsdp::agree_on_stop(dist.world(), StopRequest::signal())) ...
//   or, with the step's own per-rank numbers in the same collective:
//     auto agreed = fsdp::agree_on_stop_with(dist.world(), StopRequest::signal(), {loss, bytes});
//
// The library never installs a handler and never exits: what a stop means (save, then exit with
// 128 + signal, as fsdp-train does) is the program's decision.
#pragma once

#include <string>
#include <vector>

#include "fsdp/comm.h"

namespace fsdp {

// Process-wide record of stop requests. Every member is async-signal-safe (lock-free atomics,
// no allocation), so a signal handler may call them.
class StopRequest {
 public:
  // Records a request for signal `sig` (> 0). The first signal is kept; returns how many requests
  // have been recorded, this one included (a handler can treat the second as "stop now").
  static int record(int sig) noexcept;
  // The first recorded signal, 0 when none.
  static int signal() noexcept;
  // Forgets every request (tests, or a program that handled one and goes on).
  static void reset() noexcept;
};

// Collective over `comm` (call at the same point on every member, e.g. a step boundary): each
// rank brings its own request (`local_signal`, 0 for none) and every rank returns the same value,
// the signal of the lowest rank that has one, or 0 when no rank does. One all-gather of one
// number per rank. Throws what the collective throws (DistError, TimeoutError).
int agree_on_stop(Communicator& comm, int local_signal, const std::string& tag = "stop_request");

// agree_on_stop and an all-gather of `values` in one collective, for a program that gathers
// per-rank numbers at the step boundary anyway (a trainer's metrics): `signal` is what
// agree_on_stop returns, `values[r]` rank r's `values`. Every rank must pass as many values.
// One all-gather of 1 + values.size() doubles per rank; throws what it throws.
struct StopAgreement {
  int signal = 0;
  std::vector<std::vector<double>> values;  // by rank
};
StopAgreement agree_on_stop_with(Communicator& comm, int local_signal, const std::vector<double>& values,
                                 const std::string& tag = "stop_request");

}  // namespace fsdp
