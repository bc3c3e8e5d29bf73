// GradScaler: unscale the gradient shards, agree on inf/NaN across every rank with one all-reduce,
// skip or step, and move the scale as torch.amp.GradScaler does.
#include "fsdp/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/optim.h"
#include "kernels/ops.h"
#include "shard/grad_shards.h"
#include "shard/post_reduce_hook.h"

namespace fsdp {
namespace {

// Whether the model's optimizer applies each gradient during backward (step_in_backward).
bool applies_in_backward(FSDPModule& root) { return applies_gradients(GradShards::hook_of(root)); }

}  // namespace

void check_options(const GradScalerOptions& o) {
  if (!(o.init_scale() > 0) || !std::isfinite(o.init_scale())) {
    throw ConfigError("fsdp: GradScaler init_scale must be finite and > 0, got " + std::to_string(o.init_scale()));
  }
  if (!(o.growth_factor() > 1)) {
    throw ConfigError("fsdp: GradScaler growth_factor must be > 1, got " + std::to_string(o.growth_factor()));
  }
  if (!(o.backoff_factor() > 0 && o.backoff_factor() < 1)) {
    throw ConfigError("fsdp: GradScaler backoff_factor must be in (0, 1), got " + std::to_string(o.backoff_factor()));
  }
  if (o.growth_interval() < 1) {
    throw ConfigError("fsdp: GradScaler growth_interval must be >= 1, got " + std::to_string(o.growth_interval()));
  }
  if (o.max_consecutive_skips() < 0) {
    throw ConfigError("fsdp: GradScaler max_consecutive_skips must be >= 0, got " +
                      std::to_string(o.max_consecutive_skips()));
  }
}

GradScaler::GradScaler(std::shared_ptr<FSDPModule> root, const GradScalerOptions& options)
    : root_(std::move(root)), options_(options) {
  if (!root_) throw ConfigError("fsdp: GradScaler got a null module; pass the FSDPModule fully_shard returned");
  check_options(options_);
  state_.scale = options_.enabled() ? options_.init_scale() : 1.0;
}

void GradScaler::check_step_options(const ShardedOptimizer& optim, double max_grad_norm) const {
  if (!optim.steps_in_backward()) return;
  if (max_grad_norm > 0) {
    throw ConfigError("fsdp: the optimizer steps in backward (step_in_backward) and clipping is on (max_grad_norm " +
                      std::to_string(max_grad_norm) +
                      "): each gradient is applied during backward, before the global norm is known; turn off "
                      "clipping or step_in_backward");
  }
  if (options_.enabled()) {
    throw ConfigError(
        "fsdp: the optimizer steps in backward (step_in_backward) and the GradScaler scales the loss: scaled "
        "gradients would be applied before they could be unscaled or skipped; turn off loss scaling or "
        "step_in_backward");
  }
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  if (applies_in_backward(*root_)) {
    throw UsageError(
        "fsdp: GradScaler: the optimizer steps in backward (step_in_backward), so scaled gradients "
        "would be applied before they could be unscaled or skipped; turn off loss scaling or "
        "step_in_backward");
  }
  return loss * state_.scale;
}

bool GradScaler::unscale_and_check(const at::Tensor& local_loss, bool gradients_by_norm) {
  c10::NoGradGuard no_grad;
  GradShards shards(*root_);
  Dist& dist = shards.dist();
  at::Tensor bad = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(dist.compute_device()));
  const double inv = 1.0 / state_.scale;
  if (!(gradients_by_norm && inv == 1.0)) {
    // Collect in the order backward finished them (last units first), as clip_grad_norm does.
    shards.collect_all();
    // This rank's count of non-finite sums: a sum is inf or NaN when any element is, and costs no
    // buffer the size of the gradient. In double, a sum of finite fp32 values cannot overflow.
    for (GradShard& shard : shards.all()) {
      if (!shard.trainable()) continue;
      at::Tensor& g = shard.grad();  // collected above
      if (!g.defined()) continue;
      if (inv != 1.0) kernels::scale_(g, inv);
      bad.add_(at::isfinite(g.sum(at::kDouble)).logical_not().to(bad.device(), at::kDouble));
    }
  }
  if (local_loss.defined() && !std::isfinite(local_loss.detach().to(at::kDouble).sum().item<double>())) bad.add_(1);
  // One all-reduce over every rank (both mesh dimensions): every rank takes the same decision.
  dist.world().all_reduce(bad, ReduceOp::kSum, "grad_scaler/found_inf").wait();
  found_inf_ = bad.item<double>() > 0;
  checked_ = true;
  return found_inf_;
}

bool GradScaler::step(ShardedOptimizer& optim, double grad_norm) {
  if (optim.steps_in_backward()) {
    throw UsageError(
        "fsdp: GradScaler::step: the optimizer steps in backward (step_in_backward), so the step "
        "was taken before a non-finite gradient could skip it; call optim.step() directly, or turn "
        "off step_in_backward");
  }
  if (!checked_) unscale_and_check();
  checked_ = false;
  const bool skip = found_inf_ || !std::isfinite(grad_norm);
  if (!skip) optim.step();
  update(skip);
  return !skip;
}

void GradScaler::update(bool skipped) {
  if (skipped) {
    ++state_.skipped_steps;
    ++state_.consecutive_skips;
    if (options_.enabled()) state_.scale *= options_.backoff_factor();
    state_.growth_tracker = 0;
    const int64_t k = options_.max_consecutive_skips();
    if (k > 0 && state_.consecutive_skips >= k) {
      std::ostringstream s;
      s << "fsdp: " << state_.consecutive_skips << " steps in a row had a non-finite loss or gradient "
        << "(max_consecutive_skips=" << k << "; loss scale now " << state_.scale << "): training stopped before "
        << "anything non-finite reached the parameters. Lower the learning rate, check the data, or use bf16/fp32";
      throw NonFiniteError(s.str());
    }
    return;
  }
  state_.consecutive_skips = 0;
  if (!options_.enabled()) return;
  if (++state_.growth_tracker >= options_.growth_interval()) {
    const double grown = state_.scale * options_.growth_factor();
    if (std::isfinite(grown)) state_.scale = grown;
    state_.growth_tracker = 0;
  }
}

void GradScaler::load_state(const GradScalerState& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale) || state.growth_tracker < 0 || state.skipped_steps < 0 ||
      state.consecutive_skips < 0) {
    throw ConfigError("fsdp: GradScaler::load_state got an invalid state (scale " + std::to_string(state.scale) +
                      ", growth_tracker " + std::to_string(state.growth_tracker) + ")");
  }
  state_ = state;
  if (!options_.enabled()) state_.scale = 1.0;
}

}  // namespace fsdp
