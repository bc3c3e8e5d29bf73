// Signal handling for fsdp-train (preemption.h). The handler only touches fsdp::StopRequest
// (lock-free atomics) and, on the second signal, write(2) and _exit(2): all async-signal-safe.
#include "preemption.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "fsdp/stop.h"

namespace train {
namespace {

void on_stop_signal(int sig) {
  if (fsdp::StopRequest::record(sig) < 2) return;
  // The second request: stop now. Nothing here may allocate or lock.
  const char* text = sig == SIGINT ? "fsdp-train: second SIGINT: exiting now without finishing the save\n"
                                   : "fsdp-train: second SIGTERM: exiting now without finishing the save\n";
  const int saved_errno = errno;
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
  errno = saved_errno;
  ::_exit(128 + sig);
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGTERM, SIGINT}) {
    // An ignored SIGINT means a start in the background or under nohup: a Ctrl-C meant for the
    // foreground is not for us (fsdp-run does the same).
    struct sigaction old;
    if (sig == SIGINT && ::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    if (::sigaction(sig, &action, nullptr) != 0) {
      throw std::runtime_error(std::string("cannot install the handler for ") + stop_signal_name(sig) + ": " +
                               std::strerror(errno));
    }
  }
}

std::string stop_signal_name(int sig) {
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGINT) return "SIGINT";
  return "signal " + std::to_string(sig);
}

}  // namespace train
