// Sharded optimizers (AdamW, SGD) and the warmup-cosine schedule. Each optimizer steps one flat
// fp32 master shard at a time with element-wise ops (AdamW through the fused kernel of
// kernels/ops.h), so a shard's update is element for element the update of the same elements of
// the unsharded parameter. Clipping is in clip.cpp.
#include "fsdp/optim.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>
#include <utility>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "kernels/ops.h"
#include "optim/bf16_round.h"
#include "offload/tier_tensors.h"
#include "optim/optimizer_impl.h"
#include "optim/streamed_step.h"
#include "shard/grad_shards.h"
#include "shard/post_reduce_hook.h"

namespace fsdp {

ShardedOptimizer::Impl::Impl(ShardedOptimizer& optimizer, const std::shared_ptr<FSDPModule>& r)
    : self(optimizer), root(r), shards(*r) {
  const auto& all = shards.all();
  for (size_t i = 0; i < all.size(); ++i) {
    if (!all[i].trainable()) continue;  // frozen: no optimizer state
    ShardState s;
    s.flat_index = i;
    s.tag = all[i].tag();
    states.push_back(std::move(s));
  }
}

ShardedOptimizer::ShardedOptimizer(const std::shared_ptr<FSDPModule>& root) {
  if (!root) throw ConfigError("fsdp: optimizer got a null module; pass the FSDPModule fully_shard returned");
  impl_ = std::make_unique<Impl>(*this, root);
}

bool ShardedOptimizer::steps_in_backward() const { return impl_->in_backward != nullptr; }

double ShardedOptimizer::lr() const { return impl_->lr; }

void ShardedOptimizer::set_lr(double lr) {
  if (!(lr >= 0)) throw ConfigError("fsdp: invalid learning rate: " + std::to_string(lr));
  impl_->lr = lr;
}

void ShardedOptimizer::set_group_options(int group, const GroupOptions& options) {
  if (!(options.lr_scale() >= 0)) throw ConfigError("fsdp: invalid lr_scale for group " + std::to_string(group));
  impl_->groups[group] = options;
}

void ShardedOptimizer::set_default_weight_decay(double weight_decay) { impl_->default_weight_decay = weight_decay; }

double ShardedOptimizer::Impl::group_lr(int group) const {
  auto it = groups.find(group);
  return lr * (it == groups.end() ? 1.0 : it->second.lr_scale());
}

double ShardedOptimizer::group_lr(int group) const { return impl_->group_lr(group); }

double ShardedOptimizer::Impl::group_weight_decay(int group) const {
  auto it = groups.find(group);
  if (it != groups.end() && it->second.weight_decay()) return *it->second.weight_decay();
  return group == 0 ? default_weight_decay : 0.0;
}

at::Tensor& ShardedOptimizer::master_shard(const ShardState& s) const { return impl_->shard_of(s).master(); }

at::Tensor ShardedOptimizer::collect_grad(const ShardState& s) const { return impl_->shard_of(s).collect_grad(); }

int ShardedOptimizer::group_of(const ShardState& s) const { return impl_->shard_of(s).group(); }

bool ShardedOptimizer::state_offloaded(const ShardState& s) const { return state_tier(s) != OffloadTier::kNone; }

// Note [A step needs a gradient]
// A step with no gradient reduced since the last zero_grad() is a slip (a backward forgotten, step()
// called twice, every micro-batch without gradient sync), and would apply zero gradients: AdamW's
// moments, weight decay and step count move. A stock optimizer skips a param whose grad is undefined;
// a skip here would hide the slip as well, so it is a UsageError, before anything changes. It asks
// about the whole model (a unit that got no gradient while others did keeps its state) and is alike
// on every rank: reductions are collectives, and every rank calls zero_grad. A model with nothing
// trainable steps nothing; a step GradScaler skips never calls step(); with step_in_backward the
// reductions of the backward that stepped count as well.
void ShardedOptimizer::check_gradients_for_step() const {
  const auto reduced = [this](const ShardState& s) { return impl_->shard_of(s).reduced_since_zero_grad(); };
  if (!impl_->states.empty() && std::none_of(impl_->states.begin(), impl_->states.end(), reduced)) {
    throw UsageError("fsdp: " + type_name() +
                     ".step() with no gradient reduced since the last zero_grad(): no backward ran through the "
                     "sharded model since then (or each ran with set_requires_gradient_sync(false)), so the step "
                     "would apply zero gradients (moving momentum, weight decay and the step count). Run "
                     "loss.backward() before each step(), with gradient sync on for the last micro-batch, and "
                     "zero_grad() after it");
  }
  for (auto& s : impl_->states) impl_->shard_of(s).check_all_reduced("an optimizer step");
}

OffloadTier ShardedOptimizer::state_tier(const ShardState& s) const { return impl_->shard_of(s).state_tier(); }

std::optional<double> ShardedOptimizer::group_weight_decay_override(int group) const {
  auto it = impl_->groups.find(group);
  if (it == impl_->groups.end()) return std::nullopt;
  return it->second.weight_decay();
}

// Note [The disk tier around the step after backward]
// With optimizer state (or the master) in the disk tier and the step after backward (the default,
// and the only way to clip or scale the loss), the step would read and write every byte of state
// between the backward and the next forward. Two things move that I/O under the compute:
//  - Reads ahead. A post-reduce hook that applies nothing (clipping and loss scaling still work)
//    sees each flat param as the backward collects its reduced gradient, last units first, the
//    order the step takes them. It prepares that flat param's step job (taking the master the
//    backward's gather kept) and issues the disk reads of its first chunk when the budget has room
//    (offload::prefetch_first_chunk), so the disk reads the state on while the backward computes.
//    The job is finished in step(): its gradient is collected then (after clipping and
//    unscaling) and its learning rate and weight decay are read then. A job is prepared again
//    when the master was written since (the tier's generation moved: a checkpoint load), and
//    states() drops them all (whoever writes the states makes them stale).
//  - Writes behind. step() leaves its last writes queued, so they drain under the next forward.
//    At most half the budget drains: the forward may keep master reads for its backward in the
//    other half (Note [Kept master reads]). A read of the same range waits for them (the next
//    gather of a disk-tier master, the next step's reads); every other reader of the tier's files waits for all of them
//    first: states() and the checkpoint's model view (save, load, export). The next step() waits for them before it
//    starts, so a failed write is reported there at the latest.
// The arithmetic is unchanged, so the result is bitwise the same as without either.
struct ShardedOptimizer::Impl::ReadAhead : PostReduceHook {
  explicit ReadAhead(Impl& o) : owner(o) {}
  void gradient_reduced(GradShard& shard) override { owner.read_ahead_for(shard); }
  bool applies_gradients() const override { return false; }

  Impl& owner;
  std::unordered_map<const void*, size_t> index;  // GradShard::key() -> its place in states
  // Prepared by the backward, by place in states, with the tier's generation then: a master
  // written since (a checkpoint load) makes the job stale, and step() prepares it again.
  std::map<size_t, std::pair<offload::StepJob, uint64_t>> ready;
};

void ShardedOptimizer::Impl::install_read_ahead() {
  if (read_ahead || in_backward || shards.disk_tier() == nullptr) return;
  if (shards.hook() != nullptr || shards.in_backward()) return;  // another optimizer's
  auto ra = std::make_shared<ReadAhead>(*this);
  for (size_t i = 0; i < states.size(); ++i) ra->index[shard_of(states[i]).key()] = i;
  shards.install_hook(ra.get());
  read_ahead = std::move(ra);
}

void ShardedOptimizer::Impl::remove_read_ahead() {
  if (!read_ahead) return;
  shards.remove_hook(read_ahead.get());
  read_ahead.reset();
}

// On the training thread, from the backward's gradient hook: Note [The disk tier around the step
// after backward].
void ShardedOptimizer::Impl::read_ahead_for(GradShard& shard) {
  ReadAhead& ra = *read_ahead;
  auto it = ra.index.find(shard.key());
  if (it == ra.index.end()) return;  // frozen
  ShardState& s = states[it->second];
  if (s.tensors.empty()) return;  // created by its first step: nothing to read yet
  offload::StepJob job = make_job(s);
  offload::prefetch_first_chunk(job);
  const uint64_t generation = shards.disk_tier()->generation();
  ra.ready[it->second] = {std::move(job), generation};  // replaces one a skipped step left
}

void ShardedOptimizer::Impl::settle_writes() {
  if (offload::DiskTier* tier = shards.disk_tier()) tier->flush();
}

std::vector<ShardState>& ShardedOptimizer::states() {
  impl_->settle_writes();
  if (impl_->read_ahead) impl_->read_ahead->ready.clear();  // whoever writes the states makes them stale
  return impl_->states;
}

const std::vector<ShardState>& ShardedOptimizer::states() const { return impl_->states; }

void ShardedOptimizer::step() {
  c10::NoGradGuard no_grad;
  Tracer* tracer = impl_->shards.tracer();
  Tracer::Scope span(tracer, "fsdp::optimizer_step", "compute", "<all>");
  struct ClearObserver {  // one step only, thrown or not
    Impl& impl;
    ~ClearObserver() { impl.observer = nullptr; }
  } clear{*impl_};
  if (impl_->in_backward) {
    impl_->finish_step_in_backward(tracer);
    return;
  }
  impl_->step_after_backward(tracer);
}

void ShardedOptimizer::observe_next_step(StepObserver observer) { impl_->observer = std::move(observer); }

void ShardedOptimizer::Impl::step_after_backward(Tracer* tracer) {
  // Before anything steps: a half-stepped model would match no checkpoint.
  self.check_gradients_for_step();
  settle_writes();  // the last step's, drained under this step's forward and backward
  reserve_offloaded_state();
  // Backward reduces the last units first: step in that order, collecting each flat param's
  // gradient just before stepping it, so the last reduce-scatters overlap the first steps.
  offload::DiskTier* tier = shards.disk_tier();
  std::vector<offload::StepJob> jobs;
  for (size_t i = states.size(); i-- > 0;) {
    auto ready = read_ahead ? read_ahead->ready.find(i) : decltype(read_ahead->ready)::iterator();
    if (read_ahead && ready != read_ahead->ready.end() && ready->second.second == tier->generation()) {
      jobs.push_back(std::move(ready->second.first));
      jobs.back().step = step_fn(states[i]);  // this step's learning rate, set after backward or not
      jobs.back().observe = observer;
    } else {
      jobs.push_back(make_job(states[i]));
    }
  }
  if (read_ahead) read_ahead->ready.clear();
  offload::run_step(jobs, tracer, {/*flush=*/false, /*bump_generation=*/true});
  // What drains under the next forward holds at most half the budget: the forward may keep
  // master reads for its backward in the other half (Note [Kept master reads]).
  if (tier != nullptr && tier->budget_bytes() > 0)
    tier->wait_for_buffers(tier->budget_bytes() - tier->budget_bytes() / 2, tier->budget_bytes());
  install_read_ahead();  // from the next backward on (the state exists now)
}

offload::ShardStepFn ShardedOptimizer::Impl::step_fn(ShardState& s) {
  const int group = shard_of(s).group();
  const double lr = group_lr(group), wd = group_weight_decay(group);
  ShardedOptimizer* optimizer = &self;
  return [optimizer, lr, wd](ShardState& chunk, at::Tensor& p, const at::Tensor& g) {
    optimizer->step_shard(chunk, p, g, lr, wd);
  };
}

offload::StepJob ShardedOptimizer::Impl::make_job(ShardState& s) {
  GradShard& shard = shard_of(s);
  offload::StepJob job;
  job.state = &s;
  job.param = shard.master();
  job.param_values = shard.take_master_for_step();
  job.grad_on_disk = shard.grads_tier() == OffloadTier::kDisk;
  ShardedOptimizer* optimizer = &self;
  job.prepare = [optimizer, &s, &shard] {
    at::Tensor grad = shard.grad_for_step();
    if (!grad.defined()) return grad;
    if (s.tensors.empty()) optimizer->init_state(s);
    ++s.step;
    return grad;
  };
  job.step = step_fn(s);
  job.after = shard.after_update();
  job.observe = observer;
  return job;
}

// Note [Offloaded state is reserved before the first update]
// Disk- and host-tier optimizer state is created for every flat param before any of them steps,
// so that a full disk fails the step before it changes anything (a half-stepped model would
// differ from every checkpoint), and the free space is checked for all of it at once.
void ShardedOptimizer::Impl::reserve_offloaded_state() {
  int64_t disk_bytes = 0;
  offload::DiskTier* tier = nullptr;
  for (auto& s : states) {
    const GradShard& shard = shard_of(s);
    if (!s.tensors.empty() || shard.state_tier() != OffloadTier::kDisk) continue;
    tier = shard.disk_tier();
    disk_bytes +=
        shard.numel() * static_cast<int64_t>(c10::elementSize(self.state_dtype()) * self.state_names().size());
  }
  if (tier != nullptr) tier->check_free_space(disk_bytes, self.type_name() + " state");
  for (auto& s : states) {
    const bool offloaded = shard_of(s).state_tier() != OffloadTier::kNone;
    if (s.tensors.empty() && offloaded) self.init_state(s);
    for (const auto& [name, t] : s.tensors) {
      if (!t.defined() && offloaded) {
        throw ConfigError("fsdp: " + self.type_name() + " creates its state '" + name + "' in its first step, so it " +
                          "cannot be offloaded (" + s.tag + "); set offload.optimizer_state to \"none\"");
      }
    }
  }
}

at::Tensor ShardedOptimizer::zeros_state(ShardState& s, const std::string& name, at::ScalarType dtype) const {
  return impl_->shard_of(s).new_state_tensor(type_name() + " " + name, dtype);
}

void ShardedOptimizer::zero_grad() {
  Impl& m = *impl_;
  if (m.in_backward) m.wait_for_backward_steps();  // they read the gradient shards
  if (m.read_ahead) m.read_ahead->ready.clear();   // a skipped step's: their reads free the budget
  for (auto it = m.states.rbegin(); it != m.states.rend(); ++it) m.shard_of(*it).zero_grad();
}

int64_t ShardedOptimizer::state_bytes() const {
  int64_t total = 0;
  for (const auto& s : impl_->states) {
    for (const auto& [name, t] : s.tensors) total += t.numel() * t.element_size();
  }
  return total;
}

void check_options(const AdamWOptions& options) {
  if (!(options.lr() >= 0)) throw ConfigError("fsdp: invalid learning rate: " + std::to_string(options.lr()));
  if (!(options.beta1() >= 0 && options.beta1() < 1))
    throw ConfigError("fsdp: invalid beta1: " + std::to_string(options.beta1()) + " (must be in [0, 1))");
  if (!(options.beta2() >= 0 && options.beta2() < 1))
    throw ConfigError("fsdp: invalid beta2: " + std::to_string(options.beta2()) + " (must be in [0, 1))");
  if (!(options.eps() >= 0)) throw ConfigError("fsdp: invalid eps: " + std::to_string(options.eps()));
  if (!(options.weight_decay() >= 0)) {
    throw ConfigError("fsdp: invalid weight_decay: " + std::to_string(options.weight_decay()));
  }
  if (options.state_dtype() != at::kFloat && options.state_dtype() != at::kBFloat16) {
    throw ConfigError(std::string("fsdp: invalid AdamW state_dtype: ") + c10::toString(options.state_dtype()) +
                      " (must be Float or BFloat16)");
  }
}

namespace {

// Note [AdamW's moments in bfloat16]
// With AdamWOptions::state_dtype bf16, exp_avg and exp_avg_sq are stored in bf16 and the master
// shard stays fp32. Each chunk of the shard is widened to fp32, stepped by the same fused AdamW as
// fp32 state (so the parameter update is the fp32 arithmetic on the stored moments), and the new
// moments are rounded back to bf16 stochastically (optim/bf16_round.h): up with probability equal
// to the fraction of the way to the next bf16 value. Rounding to nearest would be biased where it
// matters most: exp_avg_sq's decay by beta2 = 0.999 changes a bf16 value by less than half its
// last place, so v * beta2 would round back to v and the second moment would never decay. The
// random bits are a hash of (flat param, step, moment, element), so a run is reproducible and the
// same whatever chunks the step streams in. A bf16 master (with stochastic rounding or a
// compensated sum) is not offered: updates of lr x ~1 fall far below a bf16 master's last place at
// fine-tuning learning rates, and a compensated bf16 pair costs the fp32 master's 4 bytes anyway.
void step_bf16_moments(ShardState& s, const at::Tensor& p, const at::Tensor& g, const kernels::AdamWArgs& args) {
  at::Tensor& m = s.tensors["exp_avg"];
  at::Tensor& v = s.tensors["exp_avg_sq"];
  constexpr int64_t kChunk = 1 << 20;  // elements widened at a time: 8 MiB of fp32 moments
  const int64_t n = p.numel();
  const at::Tensor m32 = at::empty({std::min(n, kChunk)}, p.options());
  const at::Tensor v32 = at::empty({std::min(n, kChunk)}, p.options());
  const uint32_t seed_m = bf16_round_seed(s.flat_index, s.step, 0);
  const uint32_t seed_v = bf16_round_seed(s.flat_index, s.step, 1);
  for (int64_t a = 0; a < n; a += kChunk) {
    const int64_t c = std::min(kChunk, n - a);
    const at::Tensor mc = m32.narrow(0, 0, c), vc = v32.narrow(0, 0, c);
    const at::Tensor ms = m.narrow(0, a, c), vs = v.narrow(0, a, c);
    mc.copy_(ms);
    vc.copy_(vs);
    kernels::fused_adamw(args, p.narrow(0, a, c), g.narrow(0, a, c), mc, vc);
    round_to_bf16_stochastic(mc, ms, seed_m, s.offset + a);
    round_to_bf16_stochastic(vc, vs, seed_v, s.offset + a);
  }
}

}  // namespace

AdamW::AdamW(const std::shared_ptr<FSDPModule>& root, const AdamWOptions& options)
    : ShardedOptimizer(root), options_(options) {
  check_options(options);
  set_lr(options.lr());
  set_default_weight_decay(options.weight_decay());
  if (options.state_dtype() == at::kFloat) return;
  // Where the tiers are placed already (a root initialised before the optimizer); otherwise the
  // state's first allocation refuses it (Residency::new_state_tensor), before any step.
  for (const ShardState& s : std::as_const(*this).states()) {
    if (state_tier(s) != OffloadTier::kDisk) continue;
    throw ConfigError(std::string("fsdp: AdamW's state_dtype ") + c10::toString(options.state_dtype()) + " and " +
                      s.tag + "'s optimizer state in the disk tier do not go together (the disk tier streams fp32 " +
                      "state): keep the optimizer state in RAM or the host tier (OffloadPolicy::optimizer_state), " +
                      "or the state in Float");
  }
}

void AdamW::init_state(ShardState& s) {
  // In the flat param's optimizer-state tier (RAM, host or disk).
  s.tensors["exp_avg"] = zeros_state(s, "exp_avg", options_.state_dtype());
  s.tensors["exp_avg_sq"] = zeros_state(s, "exp_avg_sq", options_.state_dtype());
}

AdamW::~AdamW() { stop_steps_in_backward(); }  // Note [The optimizer's thread stops before its subclass goes]

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
  if (s.tensors["exp_avg"].scalar_type() == at::kBFloat16) return step_bf16_moments(s, p, g, args);
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
  set_default_weight_decay(options.weight_decay());
}

std::vector<std::string> SGD::state_names() const {
  if (options_.momentum() == 0) return {};
  return {"momentum_buffer"};
}

void SGD::init_state(ShardState& s) {
  if (options_.momentum() != 0) s.tensors["momentum_buffer"] = at::Tensor();
}

SGD::~SGD() { stop_steps_in_backward(); }

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

}  // namespace fsdp
