// ShardedUnit's construction and the root's lazy init: the unit's anchor in its module, the
// gradient hooks, deferred init, and where each flat param's sharded states live (offload). Option
// resolution is in unit_options.cpp, parameter discovery and flat params in unit_params.cpp, the
// ownership of parameters and ties in tied_params.cpp.
// See sharded_unit.h.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "comm/local_group.h"
#include "fsdp/errors.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"
#include "offload/device_stager.h"
#include "frozen/frozen_storage.h"
#include "offload/placement.h"
#include "offload/rank_tiers.h"
#include "offload/tier_tensors.h"

namespace fsdp {
namespace {

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

}  // namespace

namespace detail {
ShardedUnit* unit_of(const torch::nn::Module& module) {
  const auto children = module.named_children();
  const auto* anchor = children.find(detail::kUnitAnchorName);
  if (anchor == nullptr) return nullptr;
  const auto* typed = dynamic_cast<const UnitAnchor*>(anchor->get());
  return typed ? typed->unit() : nullptr;
}
}  // namespace detail

// ---- construction

ShardedUnit::ShardedUnit(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& mesh,
                         FullyShardOptions options)
    : module_(module), mesh_(mesh), requested_(std::move(options)), options_(resolve_unit_options(requested_, mesh_)) {
  if (options_.strategy == ShardingStrategy::kNoShard) {
    // Every rank holds everything: a one-rank shard group, gradients all-reduced over the world.
    const int rank = mesh_.dist().rank();
    no_shard_group_ = make_local_group("no_shard/" + std::to_string(rank), rank);
    shard_group_ = no_shard_group_.get();
    replicate_group_ = &mesh_.dist().world();
  } else {
    shard_group_ = &mesh_.shard_group();
    replicate_group_ = &mesh_.replicate_group();
  }
  if (options_.reshard_after_forward_group > 0)
    post_forward_group_ = &mesh_.shard_subgroup(options_.reshard_after_forward_group);
}

ShardedUnit::~ShardedUnit() { forget_owned(); }

void ShardedUnit::build() {
  auto module = module_.lock();
  if (module->parameters(/*recurse=*/true).empty()) {
    throw ConfigError("fsdp: fully_shard got module " + module->name() +
                      ", which holds no parameters (nor do its children): there is nothing to shard; shard the "
                      "modules that hold parameters");
  }
  make_flat_params(*module);
  for (const auto& fp : flat_params_) {
    if (fp->needs_materialize() && !options_.init)
      throw ConfigError("fsdp: parameter '" + fp->entries().front().name +
                        "' is on the meta device but FullyShardOptions::init is not set: give it an initialiser "
                        "(fsdp/init.h), or fsdp::init::from_load() when a load or import_weights writes it first");
  }
  if (options_.vocab_parallel) check_vocab_table();
  record_owned();
  register_grad_hooks();
  module->register_module(detail::kUnitAnchorName, std::make_shared<UnitAnchor>(shared_from_this()));
}

// Counts each parameter's gradient as AccumulateGrad finishes with it. The accumulators are held
// here: autograd keeps only a weak reference to them.
void ShardedUnit::register_grad_hooks() {
  std::weak_ptr<ShardedUnit> weak = weak_from_this();
  for (size_t i = 0; i < flat_params_.size(); ++i) {
    if (!flat_params_[i]->config().requires_grad) continue;
    const auto& entries = flat_params_[i]->entries();
    for (size_t k = 0; k < entries.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(entries[k].param);
      acc->add_post_hook(std::make_unique<GradReadyHook>([weak, i, k] {
        if (auto unit = weak.lock()) unit->on_grad_ready(i, k);
      }));
      grad_accumulators_.push_back(std::move(acc));
    }
  }
}

std::vector<ShardedUnit*> ShardedUnit::subtree_units() const {
  std::vector<ShardedUnit*> out;
  auto module = module_.lock();
  for (const auto& item : module->modules(/*include_self=*/true)) {
    if (ShardedUnit* unit = detail::unit_of(*item)) out.push_back(unit);
  }
  return out;
}

// ---- the root's lazy init

// Note [Deferred init leaves what a load writes]
// A model built on the meta device and then imported (fsdp-train --init-from) or loaded would
// have each master filled twice: by its init at the root's lazy init, then by the load. With the
// master in the disk tier that is every byte written twice; with a frozen stored form, a zero fill
// of an fp32 shard and its encoding per flat param, for nothing. So a load that knows which
// parameters it writes whole (import_weights: every tensor it selects, or it throws) passes them to
// the lazy init it triggers, which leaves each flat param all of whose parameters are named
// untouched: a fresh tier file (zeros), an fp32 master whose pages are not yet faulted in (the
// padding zeroed), or a frozen shard's fp32 values awaiting their first store. The load's
// master_written() or store_frozen() ends the wait; until then the flat param cannot be
// gathered (the error asks for a lazy init), and a load that failed midway fills what it left from
// the init (finish_deferred_init), so the model is never used with unwritten values.
void ShardedUnit::lazy_init(const std::function<bool(const std::string& name)>& load_writes) {
  if (root_ == this) return;
  check_no_ties();
  auto module = module_.lock();
  root_state_ = std::make_unique<RootState>();
  root_ = this;
  prefix_ = "";
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    ShardedUnit* unit = detail::unit_of(*item.value());
    if (unit == nullptr) continue;
    if (unit != this && unit->root_ == this)  // one module instance registered at two paths
      throw ConfigError("fsdp: sharded module '" + unit->name() + "' is registered at two paths, also as '" +
                        item.key() + "': register it at one path (a unit may run more than once in a forward)");
    if (unit != this) {
      unit->root_ = this;
      unit->root_state_.reset();
      unit->prefix_ = item.key() + ".";
    }
    unit->index_ = root_state_->units.size();
    root_state_->units.push_back(unit);
  }
  for (ShardedUnit* unit : root_state_->units) {
    for (size_t i = 0; i < unit->flat_params_.size(); ++i)
      unit->flat_params_[i]->set_tag(unit->name() + "/" + std::to_string(i));
  }
  resolve_inherited_options();
  open_offload_tiers();
  place_offloaded_states();  // before materialize: deferred init writes straight into the tiers
  for (ShardedUnit* unit : root_state_->units) {
    for (auto& fp : unit->flat_params_) {
      bool written = static_cast<bool>(load_writes);
      for (const auto& e : fp->entries()) written = written && load_writes(unit->prefix_ + e.name);
      fp->materialize(unit->options_.init, unit->prefix_, written);
    }
  }
  init_buffers();
}

void ShardedUnit::finish_deferred_init() {
  for (ShardedUnit* unit : root_state_->units) {
    for (auto& fp : unit->flat_params_) {
      if (fp->awaits_load()) fp->materialize(unit->options_.init, unit->prefix_);
    }
  }
}

// Opens what the units' offload policies use: one disk tier per rank (its directory and budget
// are per rank: every unit that offloads to disk must agree with the first one that does) and
// one stager.
void ShardedUnit::open_offload_tiers() {
  RootState& rs = *root_state_;
  std::vector<std::pair<std::string, const OffloadPolicy*>> policies;
  for (ShardedUnit* unit : rs.units) policies.emplace_back(unit->name(), &unit->options_.offload);
  offload::RankTiers tiers = offload::open_rank_tiers(policies, mesh_.dist().compute_device());
  rs.disk_tier = std::move(tiers.disk);
  rs.stager = std::move(tiers.stager);
}

// Moves each flat param's states to the tiers of its unit's offload policy, once the disk's free
// space for all of them is checked.
void ShardedUnit::place_offloaded_states() {
  RootState& rs = *root_state_;
  if (!rs.disk_tier && !rs.stager) return;
  int64_t disk_bytes = 0;
  for (ShardedUnit* unit : rs.units) {
    const OffloadPolicy& policy = unit->options_.offload;
    for (auto& fp : unit->flat_params_) {
      const int64_t bytes = fp->shard_numel() * static_cast<int64_t>(sizeof(float));
      const FrozenStorage storage = fp->config().storage;
      const int64_t stored = frozen::stored_numel(storage, fp->shard_numel()) *
                             static_cast<int64_t>(c10::elementSize(frozen::stored_dtype(storage)));
      // A stored form deferred init or a load fills is reserved as it is allocated, its codes
      // perhaps read in place (Note [NF4 codes read in place], offload/residency.cpp): not here.
      if (policy.params() == OffloadTier::kDisk && !(fp->stores_frozen() && fp->needs_materialize()))
        disk_bytes += fp->stores_frozen() ? stored : bytes;
      if (policy.grads() == OffloadTier::kDisk && fp->config().requires_grad) disk_bytes += bytes;
    }
  }
  if (rs.disk_tier)
    rs.disk_tier->check_free_space(disk_bytes, "the offloaded master, stored frozen and gradient shards");
  for (ShardedUnit* unit : rs.units) {
    const OffloadPolicy& policy = unit->options_.offload;
    if (!policy.any()) continue;
    for (auto& fp : unit->flat_params_) {
      // Note [Placement rules] (offload/placement.cpp).
      const offload::StateTiers where =
          offload::place(policy, {fp->config().requires_grad, fp->stores_frozen()}, rs.stager != nullptr);
      OffloadPlacement p;
      p.params = where.working_copy ? OffloadTier::kNone : where.master;
      p.grads = where.grads;
      p.optimizer_state = where.optimizer_state;
      p.disk = rs.disk_tier;
      p.stager = rs.stager;
      fp->set_offload(std::move(p));
    }
  }
}

}  // namespace fsdp
