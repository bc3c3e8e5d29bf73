// Seams through which a test build of the trainer changes what a run does: a pause inside the
// stop's checkpoint save, non-finite gradients on chosen steps. The installed fsdp-train passes
// the defaults (no pause, no injection) and reads no test setting at all; the test-only program
// fsdp-train-test (tests/support/train_test_hooks.cpp, never installed) links the same job with
// hooks that read them from the environment.
#pragma once

#include <cstdint>
#include <set>

namespace train {

class TrainHooks {
 public:
  virtual ~TrainHooks() = default;
  // Called once before the job joins, so that a bad test setting fails at once (throws
  // std::invalid_argument naming it).
  virtual void check() const {}
  // Seconds a stop's checkpoint save pauses after the shards are written and before the commit
  // (0: none), so that a test can land its second signal in a save that is certainly in progress.
  virtual double stop_save_pause_s() const { return 0; }
  // Optimizer steps (1 = the first) on which this rank's gradient of the logits gets an inf (its
  // loss stays finite, its gradients and after the reduction every rank's shard of them do not).
  virtual std::set<int64_t> inf_grad_steps(int rank) const {
    (void)rank;
    return {};
  }
};

// fsdp-train's main, with `hooks` (the installed program passes TrainHooks{}): parses the command
// line and the config, opens the data, runs the job. Returns the exit status (fsdp_train.cpp).
int main_with_hooks(int argc, char** argv, const TrainHooks& hooks);

}  // namespace train
