// fsdp-train's answer to SIGTERM (a scheduler's or launcher's notice before SIGKILL) and SIGINT
// (Ctrl-C): the first signal asks the job to stop after the step in flight; every rank agrees on
// it at the step boundary (carried in the per-step metrics gather, with fsdp::agree_on_stop's
// rule), saves a checkpoint when --save-dir is given, and exits with 128 + signal. A second signal exits at once: the
// save in progress is abandoned and, the commit being atomic, the previous checkpoint stays as it was.
#pragma once

#include <string>

namespace train {

// Installs the handlers for SIGTERM and SIGINT (with SA_RESTART, so interrupted system calls
// resume); a SIGINT ignored at start (background, nohup) stays ignored. Call once, before the job
// starts.
void install_stop_handlers();

// "SIGTERM", "SIGINT", else "signal N".
std::string stop_signal_name(int sig);

// Seconds to pause inside a stop's checkpoint save, after the shards are written and before the
// commit, from FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S (0 when unset). A test hook: it lets a test land
// its second signal in a save that is certainly in progress. Throws std::invalid_argument when
// the value is not a number in [0, 600].
double stop_save_pause_s();

}  // namespace train
