// Seams through which a test build of the trainer changes what a run does: a hook on each phase of
// a checkpoint save (a pause in the stop's), non-finite gradients on chosen steps. The installed fsdp-train passes
// the defaults (no pause, no injection) and reads no test setting at all; the test-only program
// fsdp-train-test (tests/support/train_test_hooks.cpp, never installed) links the same job with
// hooks that read them from the environment.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>

namespace train {

class TrainHooks {
 public:
  virtual ~TrainHooks() = default;
  // Called once before the job joins, so that a bad test setting fails at once (throws
  // std::invalid_argument naming it).
  virtual void check() const {}
  // Called on this rank as each phase of every checkpoint save begins
  // (fsdp::checkpoint::SaveOptions::on_phase: "prepare", "write", "commit"); null: none.
  virtual std::function<void(const std::string& phase)> save_phases(int rank) const {
    (void)rank;
    return nullptr;
  }
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
