// Safe steps for sharded training: dynamic loss scaling for fp16 (the sharded equivalent of
// torch.amp.GradScaler) and, in every precision, skipping a step whose loss or gradients are not
// finite on any rank, with a limit on how many steps in a row may be skipped.
//
//   fsdp::GradScaler scaler(root, fsdp::GradScalerOptions().enabled(fp16).max_consecutive_skips(10));
//   scaler.scale(loss).backward();
//   if (!scaler.unscale_and_check(loss)) fsdp::clip_grad_norm(*root, 1.0);
//   scaler.step(optim);            // skipped on every rank when any rank saw inf/NaN
//   optim.zero_grad();
//
// Every rank's gradient shard holds different elements, so an overflow may show on one rank only:
// unscale_and_check agrees on it with one all-reduce of a flag over every rank of the mesh, and
// every rank then skips (or takes) the same step. Skipped steps leave the parameters and the
// optimizer's state untouched; with scaling enabled the scale backs off after a skip and grows
// after growth_interval good steps in a row.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp/fully_shard.h"

namespace fsdp {

class ShardedOptimizer;

struct GradScalerOptions {
  // Loss scaling (for fp16 compute). Off: the scale stays 1 and only the skip decision runs.
  TORCH_ARG(bool, enabled) = true;
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;   // after growth_interval good steps in a row
  TORCH_ARG(double, backoff_factor) = 0.5;  // after a skipped step
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // Throw NonFiniteError once this many steps in a row were skipped (0: never).
  TORCH_ARG(int64_t, max_consecutive_skips) = 0;
};
// Throws ConfigError naming the first invalid option (init_scale finite and > 0, growth_factor > 1,
// backoff_factor in (0, 1), growth_interval >= 1, max_consecutive_skips >= 0). The scaler's
// constructor calls it; a config parser calls it to check early.
void check_options(const GradScalerOptions& options);

// What a checkpoint needs to resume the scaler exactly.
struct GradScalerState {
  double scale = 1.0;
  int64_t growth_tracker = 0;     // good steps since the last change of scale
  int64_t skipped_steps = 0;      // total
  int64_t consecutive_skips = 0;  // in a row, up to now
};

class GradScaler {
 public:
  // Throws ConfigError for a null root or invalid options (factors, interval, scale).
  explicit GradScaler(std::shared_ptr<FSDPModule> root, const GradScalerOptions& options = {});

  // loss * scale (the loss itself when scaling is off).
  at::Tensor scale(const at::Tensor& loss) const;

  // After backward, before clipping: collects the gradient shards, divides them by the scale, and
  // agrees across every rank whether any rank's `local_loss` (optional) or gradient shard holds an
  // inf or NaN. Returns true, the same on every rank, when the step must be skipped. Collective.
  // `gradients_by_norm`: the caller clips and passes clip_grad_norm's result to step(), a norm that
  // is non-finite exactly when some gradient element is; with scaling off (nothing to divide) the
  // pass over the gradient shards is then skipped and only the loss is checked here.
  bool unscale_and_check(const at::Tensor& local_loss = {}, bool gradients_by_norm = false);

  // Steps `optim` unless unscale_and_check found a non-finite value or `grad_norm` (the result of
  // clip_grad_norm, the same on every rank) is not finite; then updates the scale and the skip
  // counters. Returns whether the optimizer stepped. Throws NonFiniteError, naming the count and
  // the scale, when max_consecutive_skips steps in a row were skipped. Calls unscale_and_check
  // first when the caller did not.
  bool step(ShardedOptimizer& optim, double grad_norm = 0.0);

  // Refuses up front what a step would refuse when it runs: with `optim` stepping in backward
  // (ShardedOptimizer::step_in_backward), clipping to `max_grad_norm` > 0 (clip_grad_norm) and
  // this scaler enabled (scale()) both need the gradients before they are applied. Throws
  // ConfigError naming the conflict; call it once the optimizer and the scaler are set up, before
  // the first step.
  void check_step_options(const ShardedOptimizer& optim, double max_grad_norm) const;

  double current_scale() const { return state_.scale; }
  bool enabled() const { return options_.enabled(); }
  const GradScalerState& state() const { return state_; }
  void load_state(const GradScalerState& state);

 private:
  void update(bool skipped);

  std::shared_ptr<FSDPModule> root_;
  GradScalerOptions options_;
  GradScalerState state_;
  bool checked_ = false;  // unscale_and_check ran since the last step
  bool found_inf_ = false;
};

}  // namespace fsdp
