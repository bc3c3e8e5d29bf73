// fsdp-train's answer to SIGTERM (a scheduler's or launcher's notice before SIGKILL) and SIGINT
// (Ctrl-C): the first signal asks the job to stop after the step in flight; every rank agrees on
// it at the step boundary (fsdp::agree_on_stop_with, which carries the step's metrics in the same
// collective; loop.cpp), saves a checkpoint when --save-dir is given, and exits with 128 + signal.
// A second signal exits at once: the save in progress is abandoned and, the commit being atomic,
// the previous checkpoint stays as it was.
#pragma once

#include <string>

namespace train {

// Installs the handlers for SIGTERM and SIGINT (with SA_RESTART, so interrupted system calls
// resume); a SIGINT ignored at start (background, nohup) stays ignored. Call once, before the job
// starts.
void install_stop_handlers();

// "SIGTERM", "SIGINT", else "signal N".
std::string stop_signal_name(int sig);

}  // namespace train
