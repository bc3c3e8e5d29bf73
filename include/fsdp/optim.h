// Optimizers that step the flat fp32 master shards of a sharded model, their state in the same
// flat layout (so a checkpoint can name every element), an LR schedule, and gradient clipping by
// the global norm across every shard of every unit.
//
//   fsdp::AdamW optim(root, fsdp::AdamWOptions(3e-4).weight_decay(0.1));
//   loss.backward(); fsdp::clip_grad_norm(*root, 1.0); optim.step(); optim.zero_grad();
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "fsdp/fully_shard.h"

namespace fsdp {

// Hyper-parameters that differ per optimizer group (see FullyShardOptions::param_group).
struct GroupOptions {
  TORCH_ARG(double, lr_scale) = 1.0;
  // Unset: the optimizer's weight_decay for group 0 and 0 for every other group.
  TORCH_ARG(std::optional<double>, weight_decay) = std::nullopt;
};

struct AdamWOptions {
  explicit AdamWOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  // The dtype of the moments exp_avg and exp_avg_sq: at::kFloat, or at::kBFloat16 (half the
  // bytes: 4 per trainable parameter instead of 8). In bf16 the update is computed in fp32 from the
  // stored moments and each new moment is rounded back stochastically (unbiased, reproducible);
  // the master shard stays fp32. Kept in RAM or the host tier (the disk tier streams fp32 state:
  // ConfigError). Checkpoints hold the moments in fp32 either way, so a run resumes with either
  // dtype. See Note [AdamW's moments in bfloat16] in src/optim/optim.cpp.
  TORCH_ARG(at::ScalarType, state_dtype) = at::kFloat;
};
// Throws ConfigError naming the first invalid option (lr >= 0, betas in [0, 1), eps >= 0,
// weight_decay >= 0, state_dtype float32 or bfloat16). AdamW's constructor calls it; a config parser calls it to check
// early.
void check_options(const AdamWOptions& options);

struct SGDOptions {
  explicit SGDOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;
};

// The optimizer state of one flat param: tensors in the flat shard layout, plus its step count.
struct ShardState {
  // Which flat param: its place in the root's order (units pre-order, then each unit's flat
  // params in order, frozen ones included), and its tag for messages ("layers.0/1").
  size_t flat_index = 0;
  std::string tag;
  std::map<std::string, at::Tensor> tensors;
  int64_t step = 0;
  // The element of the shard that tensors' first element is: 0, or a chunk's start when the step
  // streams the shard in chunks (the disk tier).
  int64_t offset = 0;
};

class ShardedOptimizer {
 public:
  explicit ShardedOptimizer(const std::shared_ptr<FSDPModule>& root);
  virtual ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // Steps every flat param that has a gradient shard (one with none, e.g. a unit unused so far,
  // is skipped and its step count stays). A step with no gradient reduced since the last
  // zero_grad() (no backward ran, or each ran with set_requires_gradient_sync(false)) is a
  // UsageError on every rank, before anything changes (Note [A step needs a gradient] in
  // optim.cpp); a model with nothing trainable steps nothing. With step_in_backward on: steps the
  // flat params the backward did not step yet and waits for those it did. With state in the disk tier, the
  // backward has read the first chunks ahead, and the last writes drain under the next forward
  // (Note [The disk tier around the step after backward] in optim.cpp).
  virtual void step();
  // Zeroes the gradient shards in place (the buffers stay).
  void zero_grad();

  // The step in backward: each flat param is stepped as soon as the backward has its reduced
  // gradient (during the next unit's backward), on a thread of the optimizer's own, while the
  // backward goes on; disk-tier state is read and written under the rest of the backward, and a
  // disk-tier master the backward's all-gather read is not read again. On a device the CPU step of
  // an offloaded optimizer state runs while the device computes the next units' backward. The
  // result is bit for bit the same as step() after backward. What changes for the caller:
  //  - every backward that reduces gradients is one optimizer step: call step() after it (it
  //    finishes the step), set the learning rate before the backward, and accumulate micro-batches
  //    with set_requires_gradient_sync(false) on all but the last;
  //  - the gradients are applied before the backward ends, so nothing can rescale or skip them:
  //    clip_grad_norm and an enabled GradScaler are refused with a UsageError.
  // Only optimizers that step shard by shard (AdamW, SGD) can; TorchOptimizer cannot (ConfigError).
  void step_in_backward(bool on);
  bool steps_in_backward() const;

  // Called with what the next step() computes, piece by piece as it goes: elements [begin, end)
  // of a flat param's shard (`state` says which), its updated fp32 master values and its updated
  // state tensors by name, in host memory and valid during the call only. A disk-tier state's
  // piece is the chunk the step holds between reading and writing it back, so whoever observes
  // gets the step's new values without reading the tier again (checkpoint::SaveInStep). Called on
  // the thread that steps that piece (the optimizer's own with step_in_backward), one call at a
  // time; it must not throw. Flat params the step skips, or stepped before this is set (in
  // backward), are not observed. One step only: step() clears it; nullptr clears it before.
  using StepObserver = std::function<void(const ShardState& state, int64_t begin, int64_t end, const at::Tensor& master,
                                          const std::map<std::string, at::Tensor>& states)>;
  void observe_next_step(StepObserver observer);

  double lr() const;
  void set_lr(double lr);
  void set_group_options(int group, const GroupOptions& options);

  // Names of the per-element state tensors, e.g. {"exp_avg", "exp_avg_sq"}.
  virtual std::vector<std::string> state_names() const = 0;
  // The states, for reading or writing their tensors (checkpoints): first waits for the writes
  // the last step left draining into the disk tier.
  std::vector<ShardState>& states();
  // The same without waiting: for their names, shapes and sizes only.
  const std::vector<ShardState>& states() const;
  // Creates a state's tensors if the optimizer has not stepped it yet (checkpoint loading).
  void ensure_state(ShardState& state) {
    if (state.tensors.empty()) init_state(state);
  }
  virtual std::string type_name() const = 0;
  // The dtype of its state tensors (all of them): the planner's and the memory report's bytes.
  virtual at::ScalarType state_dtype() const { return at::kFloat; }
  int64_t state_bytes() const;

 protected:
  virtual void init_state(ShardState& state) = 0;
  virtual void step_shard(ShardState& state, at::Tensor& param, const at::Tensor& grad, double lr,
                          double weight_decay) = 0;
  // Zeros shaped like the master shard in the flat param's optimizer-state tier (fsdp/offload.h);
  // init_state allocates its tensors with it. step_shard must update them in place. `dtype`:
  // fp32, or bf16 outside the disk tier (ConfigError there).
  at::Tensor zeros_state(ShardState& state, const std::string& name, at::ScalarType dtype = at::kFloat) const;
  // Runs what step_in_backward has queued, stops the optimizer's thread and detaches it from the
  // backward. A subclass that steps in backward calls it from its own destructor: the queued steps
  // call its step_shard, which the base class's destructor (which calls it too) can no longer reach.
  void stop_steps_in_backward();
  // The weight decay of group 0 when set_group_options gives it none (every other group's is 0
  // then): AdamW and SGD set their options' here.
  void set_default_weight_decay(double weight_decay);

  // For optimizers that step every shard at once (TorchOptimizer): a state's flat param's live
  // fp32 master shard, its gradient shard once collected (undefined when it has none yet), its
  // optimizer group and whether its optimizer state is offloaded.
  at::Tensor& master_shard(const ShardState& state) const;
  at::Tensor collect_grad(const ShardState& state) const;
  // Before a step: UsageError when no gradient was reduced since the last zero_grad (Note [A step
  // needs a gradient] in optim.cpp), or when a gradient holds sums never all-reduced across the
  // replicas (FSDPModule::set_requires_all_reduce(false) on the last micro-batch too).
  void check_gradients_for_step() const;
  int group_of(const ShardState& state) const;
  bool state_offloaded(const ShardState& state) const;
  OffloadTier state_tier(const ShardState& state) const;
  double group_lr(int group) const;
  // The group's weight decay set with set_group_options, if any.
  std::optional<double> group_weight_decay_override(int group) const;
  // Whether step_in_backward can be turned on (the optimizer steps one shard at a time).
  virtual bool can_step_in_backward() const { return true; }

 private:
  // The machinery (the gradient shards, the states, the step's jobs over the disk tier, the step in
  // backward's thread): src/optim/optimizer_impl.h.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// AdamW with decoupled weight decay: p -= lr*wd*p; then the Adam update with bias correction.
class AdamW : public ShardedOptimizer {
 public:
  AdamW(const std::shared_ptr<FSDPModule>& root, const AdamWOptions& options);
  ~AdamW() override;
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  std::string type_name() const override { return "AdamW"; }
  at::ScalarType state_dtype() const override { return options_.state_dtype(); }
  const AdamWOptions& options() const { return options_; }

 protected:
  void init_state(ShardState& state) override;
  void step_shard(ShardState& state, at::Tensor& param, const at::Tensor& grad, double lr,
                  double weight_decay) override;

 private:
  AdamWOptions options_;
};

// SGD with optional momentum, dampening, Nesterov and (coupled) weight decay, as torch.optim.SGD.
class SGD : public ShardedOptimizer {
 public:
  SGD(const std::shared_ptr<FSDPModule>& root, const SGDOptions& options);
  ~SGD() override;
  std::vector<std::string> state_names() const override;
  std::string type_name() const override { return "SGD"; }
  const SGDOptions& options() const { return options_; }

 protected:
  void init_state(ShardState& state) override;
  void step_shard(ShardState& state, at::Tensor& param, const at::Tensor& grad, double lr,
                  double weight_decay) override;

 private:
  SGDOptions options_;
};

// Learning-rate schedules: a pure function of the step, so resuming needs only the step.
class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  virtual double lr_at(int64_t step) const = 0;
  // Sets the optimizer's LR for `step` (the number of optimizer steps taken so far).
  void apply(ShardedOptimizer& optim, int64_t step) const { optim.set_lr(lr_at(step)); }
};

// Linear warmup from 0 to base_lr over warmup_steps, then cosine decay to min_lr at total_steps.
class WarmupCosine : public LRScheduler {
 public:
  WarmupCosine(double base_lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);
  double lr_at(int64_t step) const override;

 private:
  double base_lr_, min_lr_;
  int64_t warmup_steps_, total_steps_;
};

// Scales every gradient shard under `root` so that the global L2 norm (across all ranks and units)
// is at most max_norm. Returns the norm before clipping. Collective: call on every rank.
double clip_grad_norm(FSDPModule& root, double max_norm);

}  // namespace fsdp
