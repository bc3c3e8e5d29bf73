// One optimizer step of fsdp-train: gradient accumulation over micro-batches (gradients reduced on
// the last one only), loss scaling and the skip decision (fsdp::GradScaler), clipping, and the
// first measurements of what the memory levers cost, for the end-of-run report.
#pragma once

#include <cstdint>
#include <memory>
#include <set>

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include "config.h"
#include "data.h"
#include "fsdp/fully_shard.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/optim.h"
#include "fsdp/trace.h"
#include "llama.h"
#include "run_plan.h"

namespace train {

// Seconds this rank spent in each part of one step (summed over its micro-batches), for the
// metrics' phase_s breakdown.
struct PhaseTimes {
  double data = 0, forward = 0, backward = 0, check_finite = 0, clip = 0, optimizer = 0;
  // Peak RSS by phase (fsdp::sysinfo::peak_rss_bytes): forward, backward, and the rest of the step.
  int64_t peak_forward = 0, peak_backward = 0, peak_optimizer = 0;
};

struct StepOutcome {
  PhaseTimes phases;
  double local_loss = 0;  // this rank's mean over its micro-batches
  bool stepped = true;    // false: skipped on every rank (a non-finite loss or gradient somewhere)
  double grad_norm = -1;  // before clipping; -1 when clipping is off or the step was skipped
};

// Bytes in use on `device` now: the heap for the CPU, the caching allocator's allocated bytes for
// a CUDA device (where the activations live).
int64_t bytes_in_use(const c10::Device& device);

// The scaler's state for TrainState.extra["grad_scaler"], and back (a checkpoint without it, from
// before loss scaling existed, leaves the scaler as constructed).
nlohmann::json scaler_json(const fsdp::GradScaler& scaler);
void restore_scaler(fsdp::GradScaler& scaler, const nlohmann::json& extra);

class Stepper {
 public:
  // inject_steps: the steps whose gradients get an inf on this rank (TrainHooks::inf_grad_steps;
  // none outside tests).
  Stepper(const TrainConfig& cfg, const Dataset& data, llama::LlamaForCausalLM model,
          std::shared_ptr<fsdp::FSDPModule> root, fsdp::ShardedOptimizer& optim, c10::Device device, int rank,
          std::set<int64_t> inject_steps = {});

  // Trains on the global batch that starts at global sample `first` (grad_accum_steps micro-batches
  // per rank). Collective. Throws fsdp::NonFiniteError after max_consecutive_skips skips in a row.
  // `step` is the number the step will have once taken (1 for the first).
  StepOutcome run(int64_t first, int64_t step, fsdp::Tracer* tracer);

  fsdp::GradScaler& scaler() { return *scaler_; }
  // The levers measured on this rank during the second step it trains (the first materialises
  // shards and optimizer state): the activations as the growth of the compute device's memory in
  // use over one micro-batch's forward, gathered params excluded; the gradient buffers and partial
  // sums alive between micro-batches. -1 until then (and async_snapshot always: the saves').
  const MeasuredLevers& measured() const { return measured_; }
  // Per-phase peak RSS (PhaseTimes::peak_*): two /proc accesses per phase, so only when asked
  // (fsdp-train does with --metrics, whose lines carry them).
  void track_phase_peaks(bool on) { track_peaks_ = on; }

 private:
  at::Tensor micro_step(int64_t first, int64_t micro, bool measure, bool inject, fsdp::Tracer* tracer,
                        PhaseTimes& phases);
  StepOutcome finish_in_backward(int64_t step, const at::Tensor& local, fsdp::Tracer* tracer, PhaseTimes phases);

  const TrainConfig& cfg_;
  const Dataset& data_;
  llama::LlamaForCausalLM model_;
  std::shared_ptr<fsdp::FSDPModule> root_;
  fsdp::ShardedOptimizer& optim_;
  c10::Device device_;
  int rank_;
  std::unique_ptr<fsdp::GradScaler> scaler_;
  MeasuredLevers measured_;
  int64_t steps_run_ = 0;
  bool track_peaks_ = false;
  int64_t* peak_of(int64_t& field) const { return track_peaks_ ? &field : nullptr; }
  std::set<int64_t> inject_steps_;  // TrainHooks::inf_grad_steps (hooks.h)
};

}  // namespace train
