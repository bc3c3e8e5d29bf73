// The job's loop: train steps to train.steps, evaluate every train.eval_every, save every
// train.save_every and at the end, and stop after the step in flight when every rank agrees to
// (fsdp::agree_on_stop_with, preemption.h). Only rank 0 writes metrics and progress.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/offload.h"
#include "metrics.h"
#include "session.h"

namespace train {

// What the loop leaves for the final report.
struct LoopResult {
  int64_t step = 0;             // the step reached
  int64_t steps_trained = 0;    // by this run
  double train_seconds = 0;     // the loop's wall time
  double last_loss = 0;         // the last step's global loss
  int64_t last_eval_step = -1;  // -1: no evaluation ran
  double last_eval_loss = 0;
  int64_t last_saved_step = -1;
  std::string last_checkpoint;          // empty: nothing saved
  fsdp::OffloadIo offload_io_of_steps;  // the tiers' I/O during the steps after the first
  int stop_signal = 0;                  // the signal every rank agreed to stop on; 0: ran to the end
};

class Loop {
 public:
  explicit Loop(Session& session);
  // Runs to train.steps or to an agreed stop (then saves with --save-dir). Collective.
  LoopResult run();

 private:
  void train_step();
  void evaluate();
  void stop_on_request();
  void save();
  // Whether a save follows step `step` (train.save_every, or the run's last step).
  bool save_due(int64_t step) const;

  Session& s_;
  const TrainConfig& cfg_;
  const Ranks& ranks_;
  Training& t_;
  MetricsLog metrics_;
  std::unique_ptr<Progress> progress_;
  int64_t samples_seen_ = 0;
  LoopResult r_;
  double last_optimizer_s_ = 0;  // the last step's optimizer phase
};

}  // namespace train
