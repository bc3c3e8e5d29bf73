// ShardedUnit: parameter collection, the forward/backward lifecycle, and the root's lazy init.
// See the state diagram in sharded_unit.h.
#include "shard/sharded_unit.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "comm/communicator_impl.h"
#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"
#include "tiers/device_stager.h"
#include "tiers/disk_tier.h"

namespace fsdp {
namespace {

constexpr const char* kAnchorName = "_fsdp_unit";

// Registered as a child of a sharded module: how fsdp::call finds the unit, and what keeps the
// unit alive as long as its module. It holds no parameters or buffers, so state dicts and
// named_parameters() are unchanged.
class UnitAnchor : public torch::nn::Module {
 public:
  explicit UnitAnchor(std::shared_ptr<ShardedUnit> unit) : unit_(std::move(unit)) {}
  ShardedUnit* unit() const { return unit_.get(); }

 private:
  std::shared_ptr<ShardedUnit> unit_;
};

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

// Parameters owned by units nested under `module` (not counting `module`'s own unit).
void collect_nested_params(const torch::nn::Module& module, std::unordered_set<const void*>& out, bool top) {
  if (!top) {
    if (ShardedUnit* unit = unit_of(module)) {
      for (auto& fp : unit->flat_params()) {
        for (auto& e : fp->entries()) out.insert(e.param.unsafeGetTensorImpl());
      }
      return;
    }
  }
  for (const auto& child : module.named_children()) {
    if (child.key() != kAnchorName) collect_nested_params(*child.value(), out, false);
  }
}

struct Found {
  std::string name;
  at::Tensor param;
  std::vector<std::string> aliases;
};

// This unit's parameters in registration order, tied ones once, skipping nested units' subtrees.
void collect_own_params(const torch::nn::Module& module, const std::string& prefix, bool top,
                        std::vector<Found>& out, std::unordered_map<const void*, size_t>& index) {
  if (!top && unit_of(module) != nullptr) return;
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    const void* key = p.value().unsafeGetTensorImpl();
    auto it = index.find(key);
    if (it != index.end()) {
      out[it->second].aliases.push_back(prefix + p.key());
      continue;
    }
    index[key] = out.size();
    out.push_back({prefix + p.key(), p.value(), {}});
  }
  for (const auto& child : module.named_children()) {
    if (child.key() == kAnchorName) continue;
    collect_own_params(*child.value(), prefix + child.key() + ".", false, out, index);
  }
}

}  // namespace

ShardedUnit* unit_of(const torch::nn::Module& module) {
  const auto children = module.named_children();
  const auto* anchor = children.find(kAnchorName);
  if (anchor == nullptr) return nullptr;
  const auto* typed = dynamic_cast<const UnitAnchor*>(anchor->get());
  return typed ? typed->unit() : nullptr;
}

ShardedUnit::ShardedUnit(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& mesh,
                         FullyShardOptions options)
    : module_(module), mesh_(mesh), options_(std::move(options)) {
  const auto strategy = options_.strategy();
  reshard_after_forward_ = options_.reshard_after_forward().value_or(
      strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard);
  switch (strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      shard_group_ = &mesh_.shard_group();
      replicate_group_ = &mesh_.replicate_group();
      break;
    case ShardingStrategy::kHybridShard:
      if (!mesh_.is_hybrid()) {
        throw ConfigError("fsdp: HYBRID_SHARD needs a 2-D mesh with more than one replica: build it with "
                          "DeviceMesh(dist, replicate_size, shard_size); this mesh has replicate_size=" +
                          std::to_string(mesh_.replicate_size()) + ", shard_size=" +
                          std::to_string(mesh_.shard_size()));
      }
      shard_group_ = &mesh_.shard_group();
      replicate_group_ = &mesh_.replicate_group();
      break;
    case ShardingStrategy::kNoShard: {
      no_shard_group_ = make_local_group("no_shard/" + std::to_string(mesh_.dist().rank()), mesh_.dist().rank());
      shard_group_ = no_shard_group_.get();
      replicate_group_ = &mesh_.dist().world();
      reshard_after_forward_ = false;
      break;
    }
  }
  if (options_.param_dtype() && !at::isFloatingType(*options_.param_dtype())) {
    throw ConfigError("fsdp: param_dtype must be a floating type, got " +
                      std::string(c10::toString(*options_.param_dtype())));
  }
  if (options_.reduce_dtype() && !at::isFloatingType(*options_.reduce_dtype())) {
    throw ConfigError("fsdp: reduce_dtype must be a floating type, got " +
                      std::string(c10::toString(*options_.reduce_dtype())));
  }
}

ShardedUnit::~ShardedUnit() = default;

std::string ShardedUnit::name() const {
  if (prefix_.empty()) return "<root>";
  return prefix_.substr(0, prefix_.size() - 1);
}

void ShardedUnit::build() {
  auto module = module_.lock();
  std::unordered_set<const void*> nested;
  collect_nested_params(*module, nested, /*top=*/true);
  std::vector<Found> found;
  std::unordered_map<const void*, size_t> index;
  collect_own_params(*module, "", /*top=*/true, found, index);

  // One flat param per (dtype, requires_grad, optimizer group), in first-seen order.
  std::map<std::tuple<int, bool, int>, size_t> slot;
  std::vector<std::vector<FlatParamEntry>> groups;
  std::vector<FlatParamConfig> configs;
  const c10::Device device = mesh_.dist().compute_device();
  for (auto& f : found) {
    if (nested.count(f.param.unsafeGetTensorImpl())) {
      throw ConfigError("fsdp: parameter '" + f.name + "' is shared with a nested unit; tied parameters must "
                        "belong to one unit: shard their common ancestor instead of each user");
    }
    if (!f.param.is_floating_point()) {
      throw ConfigError("fsdp: parameter '" + f.name + "' has dtype " + std::string(c10::toString(f.param.scalar_type())) +
                        "; only floating-point parameters can be sharded");
    }
    const int group = options_.param_group()(f.name, f.param);
    const auto key = std::make_tuple(static_cast<int>(f.param.scalar_type()), f.param.requires_grad(), group);
    auto it = slot.find(key);
    if (it == slot.end()) {
      it = slot.emplace(key, groups.size()).first;
      groups.emplace_back();
      FlatParamConfig c;
      c.compute_dtype = options_.param_dtype().value_or(f.param.scalar_type());
      c.reduce_dtype = options_.reduce_dtype().value_or(c.compute_dtype);
      c.requires_grad = f.param.requires_grad();
      c.group = group;
      c.device = device;
      configs.push_back(c);
    }
    FlatParamEntry e;
    e.name = f.name;
    e.aliases = f.aliases;
    e.param = f.param;
    groups[it->second].push_back(std::move(e));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    configs[i].tag = "unit/" + std::to_string(i);
    flat_params_.push_back(std::make_unique<FlatParam>(std::move(groups[i]), configs[i], *shard_group_, *replicate_group_));
    has_frozen_ = has_frozen_ || !configs[i].requires_grad;
  }
  grads_landed_.assign(flat_params_.size(), 0);
  post_backward_done_.assign(flat_params_.size(), false);

  // Count each parameter's gradient as AccumulateGrad finishes with it. The accumulators are held
  // here: autograd keeps only a weak reference to them.
  std::weak_ptr<ShardedUnit> weak = weak_from_this();
  for (size_t i = 0; i < flat_params_.size(); ++i) {
    if (!flat_params_[i]->config().requires_grad) continue;
    for (const auto& e : flat_params_[i]->entries()) {
      auto acc = torch::autograd::impl::grad_accumulator(e.param);
      acc->add_post_hook(std::make_unique<GradReadyHook>([weak, i] {
        if (auto unit = weak.lock()) unit->on_grad_ready(i);
      }));
      grad_accumulators_.push_back(std::move(acc));
    }
  }
  module->register_module(kAnchorName, std::make_shared<UnitAnchor>(shared_from_this()));
}

void ShardedUnit::lazy_init() {
  if (root_ == this) return;
  auto module = module_.lock();
  root_state_ = std::make_unique<RootState>();
  root_state_->max_unsharded_units = options_.max_unsharded_units();
  root_ = this;
  prefix_ = "";
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    ShardedUnit* unit = unit_of(*item.value());
    if (unit == nullptr) continue;
    if (unit != this) {
      unit->root_ = this;
      unit->root_state_.reset();
      unit->prefix_ = item.key() + ".";
    }
    root_state_->units.push_back(unit);
  }
  for (ShardedUnit* unit : root_state_->units) {
    for (size_t i = 0; i < unit->flat_params_.size(); ++i) unit->flat_params_[i]->set_tag(unit->name() + "/" + std::to_string(i));
  }
  place_offloaded_states();  // before materialize: deferred init writes straight into the tiers
  for (ShardedUnit* unit : root_state_->units) {
    for (auto& fp : unit->flat_params_) fp->materialize(unit->options_.init(), unit->prefix_);
  }
}

// Resolves each unit's offload policy (its own, else the root's) and moves its flat params'
// states to their tiers. The disk tier's directory and budget are per rank: every unit that sets
// them must agree with the root (or with the first unit that sets them).
void ShardedUnit::place_offloaded_states() {
  RootState& rs = *root_state_;
  std::optional<OffloadPolicy> disk_policy;
  bool needs_stager = false;
  const c10::Device device = mesh_.dist().compute_device();
  for (ShardedUnit* unit : rs.units) {
    const auto& own = unit->options_.offload();
    if (!own && !options_.offload()) continue;
    const OffloadPolicy policy = own ? *own : *options_.offload();
    policy.validate();
    if (!device.is_cpu() && policy.any() &&
        (policy.params() == OffloadTier::kNone || policy.grads() == OffloadTier::kNone ||
         policy.optimizer_state() == OffloadTier::kNone)) {
      // The optimizer steps where the master shard lives, reading its gradient and state there.
      throw ConfigError(std::string("fsdp: unit '") + unit->name() + "' offloads some states but not all (params=" +
                        offload_tier_name(policy.params()) + ", grads=" + offload_tier_name(policy.grads()) +
                        ", optimizer_state=" + offload_tier_name(policy.optimizer_state()) + ") while computing on " +
                        device.str() + "; on a device the optimizer steps on the CPU, so offload params, grads "
                        "and optimizer_state together (each \"host\" or \"disk\") or none of them");
    }
    needs_stager = needs_stager || policy.uses(OffloadTier::kHost) || (policy.any() && !device.is_cpu());
    if (!policy.uses(OffloadTier::kDisk)) continue;
    if (disk_policy && (disk_policy->dir() != policy.dir() ||
                        disk_policy->memory_budget_bytes() != policy.memory_budget_bytes())) {
      throw ConfigError("fsdp: unit '" + unit->name() + "' sets offload.dir=" + policy.dir() +
                        " and offload.memory_budget_bytes=" + std::to_string(policy.memory_budget_bytes()) +
                        " but another unit set " + disk_policy->dir() + " and " +
                        std::to_string(disk_policy->memory_budget_bytes()) +
                        "; the disk tier is one per rank: set them on the root only");
    }
    disk_policy = policy;
  }
  if (disk_policy) rs.disk_tier = offload::DiskTier::open(disk_policy->dir(), disk_policy->memory_budget_bytes());
  // The stager copies host-tier states (on CPU runs too: Note [Host tier schedule]) and, on a
  // device, disk-tier states between host and device memory.
  if (needs_stager) rs.stager = offload::make_stager(device);
  if (!disk_policy && !needs_stager) return;
  int64_t disk_bytes = 0;
  for (ShardedUnit* unit : rs.units) {
    const auto& own = unit->options_.offload();
    const OffloadPolicy policy = own ? *own : options_.offload().value_or(OffloadPolicy());
    for (auto& fp : unit->flat_params_) {
      const int64_t bytes = fp->shard_numel() * static_cast<int64_t>(sizeof(float));
      if (policy.params() == OffloadTier::kDisk) disk_bytes += bytes;
      if (policy.grads() == OffloadTier::kDisk && fp->config().requires_grad) disk_bytes += bytes;
    }
  }
  if (rs.disk_tier) rs.disk_tier->check_free_space(disk_bytes, "the offloaded master and gradient shards");
  for (ShardedUnit* unit : rs.units) {
    const auto& own = unit->options_.offload();
    const OffloadPolicy policy = own ? *own : options_.offload().value_or(OffloadPolicy());
    if (!policy.any()) continue;
    for (auto& fp : unit->flat_params_) {
      OffloadPlacement p;
      p.params = policy.params();
      p.grads = fp->config().requires_grad ? policy.grads() : OffloadTier::kNone;
      p.optimizer_state = fp->config().requires_grad ? policy.optimizer_state() : OffloadTier::kNone;
      p.disk = rs.disk_tier;
      p.stager = rs.stager;
      fp->set_offload(std::move(p));
    }
  }
}

void ShardedUnit::unshard() {
  for (auto& fp : flat_params_) fp->unshard();
}

void ShardedUnit::wait_for_unshard() {
  for (auto& fp : flat_params_) fp->wait_for_unshard();
  note_memory();
}

void ShardedUnit::reshard() {
  for (auto& fp : flat_params_) fp->reshard();
}

bool ShardedUnit::is_gathered_or_gathering() const {
  for (const auto& fp : flat_params_) {
    if (fp->state() == ShardedState::kUnsharded || fp->gathering()) return true;
  }
  return false;
}

int ShardedUnit::prefetch_depth() const {
  if (options_.prefetch_depth()) return *options_.prefetch_depth();
  if (root_ != nullptr && root_->options_.prefetch_depth()) return *root_->options_.prefetch_depth();
  return 1;
}

// Issues the all-gathers of `targets` that are not gathered yet, within the root's cap on units
// gathered at once. Never waits: the target's own pre_forward / pre_backward waits.
void ShardedUnit::prefetch(const std::vector<ShardedUnit*>& targets) {
  RootState& rs = root_state();
  for (ShardedUnit* target : targets) {
    if (target == this || target->root_ != root_ || target->is_gathered_or_gathering()) continue;
    if (rs.max_unsharded_units > 0) {
      int alive = 0;
      for (ShardedUnit* u : rs.units) alive += u->is_gathered_or_gathering() ? 1 : 0;
      if (alive >= rs.max_unsharded_units) return;
    }
    target->unshard();
  }
}

void ShardedUnit::pre_forward() {
  if (root_ == nullptr) lazy_init();
  RootState& rs = root_state();
  const bool recompute = rs.in_backward;  // activation checkpointing inside backward
  if (is_root() && !recompute) rs.order.begin_step();
  if (!recompute) rs.order.record(this);
  forward_begin_ = std::chrono::steady_clock::now();
  // Our own gather goes first on the communicator's queue, the prefetches behind it.
  unshard();
  if (!recompute && prefetch_depth() > 0) {
    prefetch(forward_prefetch_.empty() ? rs.order.next_in_forward(this, prefetch_depth()) : forward_prefetch_);
  }
  wait_for_unshard();  // also records the memory peak, prefetched buffers included
  state_ = TrainingState::kForward;
}

// Note [The last unit keeps its params]
// The unit that runs forward last runs backward first (right after the root's own backward, which
// keeps its params too): resharding it after forward only to gather it again at once costs one
// all-gather per step and a wait at the start of backward that nothing overlaps. So, unless
// reshard_after_forward is set explicitly, a unit keeps its params after forward when it was the
// last to run forward in the previous step and as many units ran before it this step as then
// (the order looks the same), and gradients are on (a backward is coming). If the guess is
// wrong, the params are simply freed later: by the unit's own backward, or at the end of
// backward, or by its next forward. Peak memory is unchanged: the backward would gather the same
// unit at that point.
void ShardedUnit::post_forward() {
  // The root's backward starts right after its forward: unless told otherwise, keep its params
  // (saves one all-gather of the root per step). A recomputation inside backward (activation
  // checkpointing) keeps them too: its backward follows at once.
  RootState& rs = root_state();
  const bool in_backward = rs.in_backward;
  const bool by_default = !options_.reshard_after_forward().has_value();
  const bool root_keeps = is_root() && by_default;
  // See Note [The last unit keeps its params].
  const auto& last_order = rs.order.predicted();
  const bool last_keeps = by_default && c10::GradMode::is_enabled() && !last_order.empty() &&
                          last_order.back() == this && rs.order.recorded().size() == last_order.size();
  if (reshard_after_forward_ && !root_keeps && !last_keeps && !in_backward) reshard();
  state_ = in_backward ? TrainingState::kPreBackward : TrainingState::kIdle;
  if (Tracer* t = tracer()) t->span("fsdp::forward", "compute", forward_begin_, std::chrono::steady_clock::now(), name());
}

void ShardedUnit::pre_backward() {
  RootState& rs = root_state();
  if (!rs.callback_queued) {
    rs.callback_queued = true;
    rs.in_backward = true;
    ShardedUnit* root = root_;
    torch::autograd::Engine::get_default_engine().queue_callback([root] { root->finalize_backward(); });
  }
  if (state_ != TrainingState::kPreBackward) backward_begin_ = std::chrono::steady_clock::now();
  unshard();
  if (prefetch_depth() > 0) {
    prefetch(backward_prefetch_.empty() ? rs.order.next_in_backward(this, prefetch_depth()) : backward_prefetch_);
  }
  wait_for_unshard();
  for (auto& fp : flat_params_) fp->prepare_gradients();
  note_memory();
  state_ = TrainingState::kPreBackward;
}

void ShardedUnit::on_grad_ready(size_t i) {
  if (++grads_landed_[i] == flat_params_[i]->entries().size()) post_backward(i);
}

void ShardedUnit::post_backward(size_t i) {
  if (post_backward_done_[i]) return;
  post_backward_done_[i] = true;
  if (requires_gradient_sync_) {
    // Reductions issued by earlier units have had this unit's backward to finish: collect them now,
    // which frees their gradient buffers, so at most one unit's gradients wait on the wire besides
    // this unit's own. This unit's other flat params' reductions were issued a moment ago (a unit's
    // flat params finish backward together): waiting for those would serialise every reduction
    // with the backward, so they stay pending until the next unit's.
    RootState& rs = root_state();
    std::vector<FlatParam*> own;
    for (FlatParam* fp : rs.pending_reduces) {
      const bool mine = std::any_of(flat_params_.begin(), flat_params_.end(),
                                    [fp](const std::unique_ptr<FlatParam>& f) { return f.get() == fp; });
      if (mine) own.push_back(fp); else fp->finalize_grads();
    }
    rs.pending_reduces = std::move(own);
    flat_params_[i]->reduce_scatter_grads();
    rs.pending_reduces.push_back(flat_params_[i].get());
  }
  // Free the params once every trainable flat param is done. Frozen params may still be read by
  // backward nodes that produce no parameter gradient: those wait for finalize_backward.
  bool all_done = !has_frozen_;
  for (size_t k = 0; k < flat_params_.size() && all_done; ++k) {
    all_done = post_backward_done_[k] || !flat_params_[k]->config().requires_grad;
  }
  if (all_done) {
    reshard();
    state_ = TrainingState::kPostBackward;
    if (Tracer* t = tracer()) t->span("fsdp::backward", "compute", backward_begin_, std::chrono::steady_clock::now(), name());
  }
}

// Note [Lazy gradient collection]
// The end of backward issues the reductions that did not start yet but waits for none: the
// optimizer collects each flat param's gradient just before stepping it (collect_gradients for
// everything at once, e.g. for clipping), so its step overlaps the last reduce-scatters. A
// reduction nobody collected is collected before its buffer is reused in the next backward.
void ShardedUnit::finalize_backward() {
  RootState& rs = root_state();
  // Units whose gradients did not all land (unused params, a skipped unit) are reduced now; the
  // order is the same on every rank because the unit list is.
  for (ShardedUnit* unit : rs.units) {
    if (!unit->requires_gradient_sync_) continue;
    for (auto& fp : unit->flat_params_) {
      if (fp->gradients_prepared()) fp->reduce_scatter_grads();
    }
  }
  rs.pending_reduces.clear();
  Tracer* t = tracer();
  for (ShardedUnit* unit : rs.units) {
    if (t != nullptr && unit->state_ == TrainingState::kPreBackward) {
      t->span("fsdp::backward", "compute", unit->backward_begin_, std::chrono::steady_clock::now(), unit->name());
    }
    unit->reshard();
    unit->reset_after_backward();
  }
  rs.callback_queued = false;
  rs.in_backward = false;
}

void ShardedUnit::collect_gradients() {
  for (auto& fp : flat_params_) fp->finalize_grads();
}

void ShardedUnit::reset_after_backward() {
  std::fill(grads_landed_.begin(), grads_landed_.end(), 0);
  std::fill(post_backward_done_.begin(), post_backward_done_.end(), false);
  state_ = TrainingState::kIdle;
}

void ShardedUnit::note_memory() {
  if (root_ == nullptr) return;
  RootState& rs = root_state();
  int64_t alive = 0;
  int gathered = 0;
  for (ShardedUnit* unit : rs.units) {
    for (auto& fp : unit->flat_params_) alive += fp->unsharded_bytes() + fp->unsharded_grad_bytes();
    gathered += unit->is_gathered_or_gathering() ? 1 : 0;
  }
  rs.peak_unsharded_bytes = std::max(rs.peak_unsharded_bytes, alive);
  rs.peak_gathered_units = std::max(rs.peak_gathered_units, gathered);
}

// ---- public entry points ------------------------------------------------------------------------

std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<torch::nn::Module>& module, DeviceMesh& mesh,
                                        const FullyShardOptions& options) {
  if (!module) throw ConfigError("fsdp: fully_shard got a null module");
  if (unit_of(*module) != nullptr) {
    throw ConfigError("fsdp: fully_shard was already applied to this module (" + module->name() + ")");
  }
  auto unit = std::make_shared<ShardedUnit>(module, mesh, options);
  unit->build();
  return std::make_shared<FSDPModule>(unit);
}

std::vector<ShardedUnit*> ShardedUnit::subtree_units() const {
  std::vector<ShardedUnit*> out;
  auto module = module_.lock();
  for (const auto& item : module->modules(/*include_self=*/true)) {
    if (ShardedUnit* unit = unit_of(*item)) out.push_back(unit);
  }
  return out;
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  for (ShardedUnit* unit : unit_->subtree_units()) unit->set_requires_gradient_sync(sync);
}

void FSDPModule::set_tracer(std::shared_ptr<Tracer> tracer) {
  if (unit_->root() != unit_.get()) unit_->lazy_init();
  unit_->root_state().tracer = tracer;
  for (ShardedUnit* unit : unit_->root_state().units) {
    for (auto& fp : unit->flat_params()) {
      fp->shard_group().set_tracer(tracer);
      fp->replicate_group().set_tracer(tracer);
    }
  }
}

std::shared_ptr<UnshardHandle> FSDPModule::unshard(bool async) {
  if (unit_->root() == nullptr) unit_->lazy_init();
  unit_->unshard();
  auto handle = std::make_shared<UnshardHandle>(unit_);
  if (!async) handle->wait();
  return handle;
}

void FSDPModule::reshard() { unit_->reshard(); }

void UnshardHandle::wait() {
  if (unit_) unit_->wait_for_unshard();
  unit_.reset();
}

namespace {
std::vector<ShardedUnit*> raw_units(const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  std::vector<ShardedUnit*> out;
  for (const auto& m : modules) {
    if (!m) throw ConfigError("fsdp: a prefetch list holds a null module");
    out.push_back(&m->unit());
  }
  return out;
}
}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  unit_->set_forward_prefetch(raw_units(modules));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  unit_->set_backward_prefetch(raw_units(modules));
}

std::vector<std::shared_ptr<ShardedUnit>> FSDPModule::units() const {
  if (unit_->root() == nullptr) unit_->lazy_init();
  std::vector<std::shared_ptr<ShardedUnit>> out;
  for (ShardedUnit* unit : unit_->subtree_units()) out.push_back(unit->shared_from_this());
  return out;
}

namespace detail {

ForwardScope::ForwardScope(ShardedUnit& unit) : unit_(unit) { unit_.pre_forward(); }

ForwardScope::~ForwardScope() {
  if (finished_) return;
  try {
    unit_.post_forward();  // an exception escaped the forward; leave the unit consistent
  } catch (...) {
  }
}

at::Tensor ForwardScope::input(const at::Tensor& t) {
  const auto& dtype = unit_.options().param_dtype();
  if (dtype && t.defined() && t.is_floating_point() && t.scalar_type() != *dtype) return t.to(*dtype);
  return t;
}

at::Tensor ForwardScope::output(const at::Tensor& t) {
  at::Tensor out = t;
  const auto& dtype = unit_.options().output_dtype();
  if (dtype && out.defined() && out.is_floating_point() && out.scalar_type() != *dtype) out = out.to(*dtype);
  if (out.defined() && out.requires_grad()) {
    std::weak_ptr<ShardedUnit> weak = unit_.weak_from_this();
    out.register_hook([weak](const at::Tensor&) {
      if (auto unit = weak.lock()) unit->pre_backward();
    });
  }
  return out;
}

void ForwardScope::finish() {
  finished_ = true;
  unit_.post_forward();
}

}  // namespace detail
}  // namespace fsdp
