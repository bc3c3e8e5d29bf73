// Sharded optimizers (AdamW, SGD), the warmup-cosine schedule and global-norm clipping. Each
// optimizer steps one flat fp32 master shard at a time with element-wise ops (AdamW and clipping
// through the fused kernels of kernels/ops.h), so a shard's update is element for element the
// update of the same elements of the unsharded parameter.
#include "fsdp/optim.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "kernels/ops.h"
#include "shard/streamed_step.h"
#include "tiers/disk_tier.h"
#include "shard/sharded_unit.h"

namespace fsdp {

struct ShardedOptimizer::Flats : std::vector<FlatParam*> {
  using std::vector<FlatParam*>::vector;
};

ShardedOptimizer::ShardedOptimizer(const std::shared_ptr<FSDPModule>& root) : root_(root) {
  if (!root_) throw ConfigError("fsdp: optimizer got a null module; pass the FSDPModule fully_shard returned");
  const auto all = flat_params_of(*root_);
  flats_ = std::make_shared<Flats>(all.begin(), all.end());
  const Flats& flats = *flats_;
  for (size_t i = 0; i < flats.size(); ++i) {
    if (!flats[i]->config().requires_grad) continue;  // frozen: no optimizer state
    ShardState s;
    s.flat_index = i;
    s.tag = flats[i]->config().tag;
    states_.push_back(std::move(s));
  }
}

void ShardedOptimizer::set_lr(double lr) {
  if (!(lr >= 0)) throw ConfigError("fsdp: invalid learning rate: " + std::to_string(lr));
  lr_ = lr;
}

void ShardedOptimizer::set_group_options(int group, const GroupOptions& options) {
  if (!(options.lr_scale() >= 0)) throw ConfigError("fsdp: invalid lr_scale for group " + std::to_string(group));
  groups_[group] = options;
}

double ShardedOptimizer::group_lr(int group) const {
  auto it = groups_.find(group);
  return lr_ * (it == groups_.end() ? 1.0 : it->second.lr_scale());
}

double ShardedOptimizer::group_weight_decay(int group) const {
  auto it = groups_.find(group);
  if (it != groups_.end() && it->second.weight_decay()) return *it->second.weight_decay();
  return group == 0 ? default_weight_decay_ : 0.0;
}

FlatParam& ShardedOptimizer::flat_of(const ShardState& s) const { return *flats_->at(s.flat_index); }

at::Tensor& ShardedOptimizer::master_shard(const ShardState& s) const {
  return flats_->at(s.flat_index)->sharded_param();
}

at::Tensor ShardedOptimizer::collect_grad(const ShardState& s) const {
  FlatParam& flat = *flats_->at(s.flat_index);
  flat.finalize_grads();
  return flat.sharded_grad();
}

int ShardedOptimizer::group_of(const ShardState& s) const { return flats_->at(s.flat_index)->config().group; }

bool ShardedOptimizer::state_offloaded(const ShardState& s) const {
  return flats_->at(s.flat_index)->offload().optimizer_state != OffloadTier::kNone;
}

std::optional<double> ShardedOptimizer::group_weight_decay_override(int group) const {
  auto it = groups_.find(group);
  if (it == groups_.end()) return std::nullopt;
  return it->second.weight_decay();
}

void ShardedOptimizer::step() {
  c10::NoGradGuard no_grad;
  Tracer* tracer = unit_of(*root_).tracer();
  Tracer::Scope span(tracer, "fsdp::optimizer_step", "compute", "<all>");
  if (in_backward_) {
    finish_step_in_backward(tracer);
    return;
  }
  reserve_offloaded_state();
  // Backward reduces the last units first: step in that order, collecting each flat param's
  // gradient just before stepping it, so the last reduce-scatters overlap the first steps.
  std::vector<offload::StepJob> jobs;
  for (auto it = states_.rbegin(); it != states_.rend(); ++it) jobs.push_back(make_job(*it));
  offload::run_step(jobs, tracer);
}

offload::StepJob ShardedOptimizer::make_job(ShardState& s) {
  FlatParam& flat = flat_of(s);
  const int group = flat.config().group;
  const double lr = group_lr(group), wd = group_weight_decay(group);
  offload::StepJob job;
  job.state = &s;
  job.param = flat.optimizer_master();
  job.param_values = flat.take_master_for_step();
  job.grad_on_disk = flat.offload().grads == OffloadTier::kDisk;
  job.prepare = [this, &s, &flat] {
    at::Tensor grad = flat.optimizer_grad();
    if (!grad.defined()) return grad;
    if (s.tensors.empty()) init_state(s);
    ++s.step;
    return grad;
  };
  job.step = [this, lr, wd](ShardState& chunk, at::Tensor& p, const at::Tensor& g) { step_shard(chunk, p, g, lr, wd); };
  job.after = flat.after_optimizer_update();
  return job;
}

// Note [Offloaded state is reserved before the first update]
// Disk- and host-tier optimizer state is created for every flat param before any of them steps,
// so that a full disk fails the step before it changes anything (a half-stepped model would
// differ from every checkpoint), and the free space is checked for all of it at once.
void ShardedOptimizer::reserve_offloaded_state() {
  int64_t disk_bytes = 0;
  offload::DiskTier* tier = nullptr;
  const Flats& flats = *flats_;
  for (auto& s : states_) {
    const FlatParam& flat = *flats.at(s.flat_index);
    if (!s.tensors.empty() || flat.offload().optimizer_state != OffloadTier::kDisk) continue;
    tier = flat.offload().disk.get();
    disk_bytes += flat.shard_numel() * static_cast<int64_t>(sizeof(float) * state_names().size());
  }
  if (tier != nullptr) tier->check_free_space(disk_bytes, type_name() + " state");
  for (auto& s : states_) {
    const bool offloaded = flats.at(s.flat_index)->offload().optimizer_state != OffloadTier::kNone;
    if (s.tensors.empty() && offloaded) init_state(s);
    for (const auto& [name, t] : s.tensors) {
      if (!t.defined() && offloaded) {
        throw ConfigError("fsdp: " + type_name() + " creates its state '" + name + "' in its first step, so it " +
                          "cannot be offloaded (" + s.tag + "); set offload.optimizer_state to \"none\"");
      }
    }
  }
}

at::Tensor ShardedOptimizer::zeros_state(ShardState& s, const std::string& name) const {
  return flats_->at(s.flat_index)->new_state_tensor(type_name() + " " + name);
}

void ShardedOptimizer::zero_grad() {
  if (in_backward_) wait_for_backward_steps();  // they read the gradient shards
  const Flats& flats = *flats_;
  for (auto it = states_.rbegin(); it != states_.rend(); ++it) {
    FlatParam& flat = *flats.at(it->flat_index);
    flat.finalize_grads();
    flat.zero_grad();
  }
}

int64_t ShardedOptimizer::state_bytes() const {
  int64_t total = 0;
  for (const auto& s : states_) {
    for (const auto& [name, t] : s.tensors) total += t.numel() * t.element_size();
  }
  return total;
}

AdamW::AdamW(const std::shared_ptr<FSDPModule>& root, const AdamWOptions& options)
    : ShardedOptimizer(root), options_(options) {
  set_lr(options.lr());
  if (!(options.beta1() >= 0 && options.beta1() < 1))
    throw ConfigError("fsdp: invalid beta1: " + std::to_string(options.beta1()));
  if (!(options.beta2() >= 0 && options.beta2() < 1))
    throw ConfigError("fsdp: invalid beta2: " + std::to_string(options.beta2()));
  if (!(options.eps() >= 0)) throw ConfigError("fsdp: invalid eps: " + std::to_string(options.eps()));
  if (!(options.weight_decay() >= 0)) {
    throw ConfigError("fsdp: invalid weight_decay: " + std::to_string(options.weight_decay()));
  }
  default_weight_decay_ = options.weight_decay();
}

void AdamW::init_state(ShardState& s) {
  // In the flat param's optimizer-state tier (RAM, host or disk).
  s.tensors["exp_avg"] = zeros_state(s, "exp_avg");
  s.tensors["exp_avg_sq"] = zeros_state(s, "exp_avg_sq");
}

void AdamW::step_shard(ShardState& s, at::Tensor& p, const at::Tensor& g, double lr, double wd) {
  // One fused pass over the shard (or a chunk view of it), the same update as the ATen sequence
  // p.mul_(1-lr*wd); m.lerp_(g,1-b1); v.mul_(b2).addcmul_(g,g,1-b2); p.addcdiv_(m, v.sqrt()/sqrt(bc2)+eps,
  // -lr/bc1): see kernels/ops.h and Note [Twin numerics] in kernels/ops.cpp.
  kernels::AdamWArgs args;
  args.lr = lr;
  args.beta1 = options_.beta1();
  args.beta2 = options_.beta2();
  args.eps = options_.eps();
  args.weight_decay = wd;
  args.step = s.step;
  kernels::fused_adamw(args, p, g, s.tensors["exp_avg"], s.tensors["exp_avg_sq"]);
}

SGD::SGD(const std::shared_ptr<FSDPModule>& root, const SGDOptions& options)
    : ShardedOptimizer(root), options_(options) {
  set_lr(options.lr());
  if (!(options.momentum() >= 0)) throw ConfigError("fsdp: invalid momentum: " + std::to_string(options.momentum()));
  if (!(options.weight_decay() >= 0)) {
    throw ConfigError("fsdp: invalid weight_decay: " + std::to_string(options.weight_decay()));
  }
  if (options.nesterov() && (options.momentum() <= 0 || options.dampening() != 0)) {
    throw ConfigError("fsdp: Nesterov momentum requires a momentum and zero dampening");
  }
  default_weight_decay_ = options.weight_decay();
}

std::vector<std::string> SGD::state_names() const {
  if (options_.momentum() == 0) return {};
  return {"momentum_buffer"};
}

void SGD::init_state(ShardState& s) {
  if (options_.momentum() != 0) s.tensors["momentum_buffer"] = at::Tensor();
}

void SGD::step_shard(ShardState& s, at::Tensor& p, const at::Tensor& grad, double lr, double wd) {
  at::Tensor g = wd != 0 ? grad.add(p, wd) : grad;
  if (options_.momentum() != 0) {
    auto& buf = s.tensors["momentum_buffer"];
    if (!buf.defined()) {
      buf = g.clone();
    } else {
      buf.mul_(options_.momentum()).add_(g, 1 - options_.dampening());
    }
    g = options_.nesterov() ? g.add(buf, options_.momentum()) : buf;
  }
  p.add_(g, -lr);
}

WarmupCosine::WarmupCosine(double base_lr, int64_t warmup_steps, int64_t total_steps, double min_lr)
    : base_lr_(base_lr), min_lr_(min_lr), warmup_steps_(warmup_steps), total_steps_(total_steps) {
  if (warmup_steps < 0 || total_steps < 0) {
    throw ConfigError("fsdp: WarmupCosine needs warmup_steps >= 0 and total_steps >= 0, got " +
                      std::to_string(warmup_steps) + " and " + std::to_string(total_steps));
  }
}

double WarmupCosine::lr_at(int64_t step) const {
  if (step < warmup_steps_) return base_lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  if (total_steps_ <= warmup_steps_) return base_lr_;
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps_) / static_cast<double>(total_steps_ - warmup_steps_));
  return min_lr_ + 0.5 * (base_lr_ - min_lr_) * (1.0 + std::cos(M_PI * progress));
}

double clip_grad_norm(FSDPModule& root, double max_norm) {
  if (!(max_norm > 0)) throw ConfigError("fsdp: clip_grad_norm needs max_norm > 0, got " + std::to_string(max_norm));
  if (unit_of(root).steps_in_backward()) {
    throw UsageError(
        "fsdp: clip_grad_norm: the optimizer steps in backward (step_in_backward), so each gradient "
        "was applied before the global norm was known; turn off clipping or step_in_backward");
  }
  // Sum of squares per shard group: elements are distinct within a shard group and identical
  // across replicas, so each group is reduced once and replicas are not counted twice. Groups are
  // kept in unit order, which is the same on every rank, so the all-reduces are too; every rank
  // reduces every group, with or without gradients of its own.
  std::vector<std::pair<Communicator*, at::Tensor>> partial;
  std::vector<at::Tensor> grads;
  const auto units = units_of(root);
  for (auto it = units.rbegin(); it != units.rend(); ++it) (*it)->collect_gradients();
  for (ShardedUnit* unit : units) {
    for (auto& fp : unit->flat_params()) {
      if (!fp->config().requires_grad) continue;
      Communicator* group = fp->shard_group().size() > 1 ? &fp->shard_group() : nullptr;
      auto it = std::find_if(partial.begin(), partial.end(), [&](const auto& p) { return p.first == group; });
      if (it == partial.end()) {
        partial.emplace_back(group, at::Tensor());
        it = partial.end() - 1;
      }
      auto& g = fp->sharded_grad();
      if (!g.defined()) continue;
      grads.push_back(g);
      // The partial sum lives where the group's first gradient does: on a device, no host sync
      // per flat param.
      if (!it->second.defined()) it->second = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(g.device()));
      if (g.device() == it->second.device()) {
        kernels::sum_of_squares(g, it->second);  // accumulates in double
      } else {
        auto sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(g.device()));
        kernels::sum_of_squares(g, sq);
        it->second.add_(sq.to(it->second.device()));
      }
    }
  }
  double total_sq = 0;
  for (auto& [group, sq] : partial) {
    if (!sq.defined()) sq = at::zeros({1}, at::kDouble);  // no gradient here yet: still takes part
    if (group != nullptr) group->all_reduce(sq, ReduceOp::kSum, "clip_grad_norm").wait();
    total_sq += sq.item<double>();
  }
  const double norm = std::sqrt(total_sq);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    for (auto& g : grads) kernels::scale_(g, coef);
  }
  return norm;
}

}  // namespace fsdp
