// ShardedUnit's construction and the root's lazy init: option resolution, parameter discovery and
// flat params, the gradient hooks, and where each flat param's sharded states live (offload).
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

#include "comm/communicator_impl.h"
#include "fsdp/errors.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"
#include "offload/device_stager.h"
#include "offload/placement.h"
#include "offload/rank_tiers.h"
#include "offload/tier_tensors.h"

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

// Parameters owned by units nested under `module` (not counting `module`'s own unit), with the
// unit that owns each; each nested unit learns the unit applied over it and its path there.
using NestedOwners = std::unordered_map<const void*, ShardedUnit*>;
void collect_nested_params(const torch::nn::Module& module, const std::string& path,
                           const std::weak_ptr<ShardedUnit>& enclosing, NestedOwners& out, bool top) {
  if (!top) {
    if (ShardedUnit* unit = detail::unit_of(module)) {
      unit->mark_nested(enclosing, path);
      for (auto& fp : unit->flat_params()) {
        for (auto& e : fp->entries()) out[e.param.unsafeGetTensorImpl()] = unit;
      }
      return;
    }
  }
  for (const auto& child : module.named_children()) {
    if (child.key() == kAnchorName) continue;
    collect_nested_params(*child.value(), path.empty() ? child.key() : path + "." + child.key(), enclosing, out, false);
  }
}

// `inner`'s path in `outer`'s module tree ("" for outer itself), if it is there.
std::optional<std::string> path_in(const torch::nn::Module& outer, const torch::nn::Module* inner) {
  for (const auto& item : outer.named_modules("", /*include_self=*/true)) {
    if (item.value().get() == inner) return item.key();
  }
  return std::nullopt;
}

struct Found {
  std::string name;
  at::Tensor param;
  std::vector<std::string> aliases;
};

// This unit's parameters in registration order, tied ones once, skipping nested units' subtrees.
void collect_own_params(const torch::nn::Module& module, const std::string& prefix, bool top, std::vector<Found>& out,
                        std::unordered_map<const void*, size_t>& index) {
  if (!top && detail::unit_of(module) != nullptr) return;
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

void check_param(const Found& f) {
  if (!f.param.is_floating_point()) {
    throw ConfigError("fsdp: parameter '" + f.name + "' has dtype " +
                      std::string(c10::toString(f.param.scalar_type())) +
                      "; only floating-point parameters can be sharded");
  }
}

// The strategy's mesh: FULL_SHARD and SHARD_GRAD_OP shard over every rank of a 1-D mesh, and
// HYBRID_SHARD needs rows to replicate across. A 2-D mesh with FULL_SHARD used to shard within a
// row and replicate across rows, which is HYBRID_SHARD under another name: refused rather than
// guessed, so that a config says what it does.
void check_strategy_fits_mesh(ShardingStrategy strategy, const DeviceMesh& mesh) {
  const std::string shape =
      "replicate_size=" + std::to_string(mesh.replicate_size()) + ", shard_size=" + std::to_string(mesh.shard_size());
  switch (strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (mesh.is_hybrid()) {
        throw ConfigError(std::string("fsdp: ") + strategy_name(strategy) +
                          " needs a 1-D mesh, but this mesh is 2-D (" + shape +
                          "): use HYBRID_SHARD to shard within rows and replicate across them, or a 1-D "
                          "DeviceMesh(dist) to shard over every rank");
      }
      break;
    case ShardingStrategy::kHybridShard:
      if (!mesh.is_hybrid()) {
        throw ConfigError(
            "fsdp: HYBRID_SHARD needs a 2-D mesh with more than one replica: build it with "
            "DeviceMesh(dist, replicate_size, shard_size); this mesh has " +
            shape);
      }
      break;
    case ShardingStrategy::kNoShard: break;
  }
}

void check_floating(const char* field, const std::optional<at::ScalarType>& dtype) {
  if (dtype && !at::isFloatingType(*dtype)) {
    throw ConfigError(std::string("fsdp: ") + field + " must be a floating type, got " +
                      std::string(c10::toString(*dtype)));
  }
}

using offload::master_follows_state;  // Note [Placement rules]

}  // namespace

namespace detail {
ShardedUnit* unit_of(const torch::nn::Module& module) {
  const auto children = module.named_children();
  const auto* anchor = children.find(kAnchorName);
  if (anchor == nullptr) return nullptr;
  const auto* typed = dynamic_cast<const UnitAnchor*>(anchor->get());
  return typed ? typed->unit() : nullptr;
}
}  // namespace detail

// ---- options

ResolvedOptions resolve_unit_options(const FullyShardOptions& options, const DeviceMesh& mesh) {
  ResolvedOptions r;
  r.strategy = options.strategy();
  check_strategy_fits_mesh(r.strategy, mesh);
  resolve_reshard_after_forward(options, mesh.shard_size(), r);
  r.replicate_params = r.strategy == ShardingStrategy::kNoShard ? nullptr : options.replicate_params();
  r.mp_policy = options.mp_policy();
  check_floating("param_dtype", r.mp_policy.param_dtype());
  check_floating("reduce_dtype", r.mp_policy.reduce_dtype());
  r.param_group = options.param_group();
  r.init = options.init();
  r.frozen_storage = options.frozen_storage();
  r.vocab_parallel = options.vocab_parallel();
  return r;
}

// Every unit under the root, once the root is known: what a unit leaves unset comes from the
// root's options. Runs again if a larger root claims units that lazy-initialised on their own.
void ShardedUnit::resolve_inherited_options() {
  const c10::Device device = mesh_.dist().compute_device();
  for (ShardedUnit* unit : root_state_->units) {
    const FullyShardOptions& own = unit->requested_;
    ResolvedOptions& o = unit->options_;
    o.prefetch_depth = own.prefetch_depth().value_or(requested_.prefetch_depth().value_or(1));
    o.max_unsharded_units = requested_.max_unsharded_units();
    o.offload = own.offload() ? *own.offload() : requested_.offload().value_or(OffloadPolicy());
    o.offload.validate();
    offload::check_allowed_on_device(o.offload, unit->name(), device.is_cpu(), device.str());
  }
}

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
  module->register_module(kAnchorName, std::make_shared<UnitAnchor>(shared_from_this()));
}

// FullyShardOptions::vocab_parallel: one frozen 2-D parameter, sharded (fsdp/vocab_parallel.h).
void ShardedUnit::check_vocab_table() const {
  const auto module = module_.lock();
  const std::string what = "fsdp: fully_shard with vocab_parallel on " + (module ? module->name() : std::string("?"));
  if (flat_params_.size() != 1 || flat_params_[0]->entries().size() != 1) {
    throw ConfigError(what +
                      ": the module must hold exactly one parameter (its [vocab, dim] table); shard the "
                      "table's own module (e.g. the embedding), not a module around it");
  }
  const FlatParam& fp = *flat_params_[0];
  const FlatParamEntry& e = fp.entries()[0];
  if (e.shape.size() != 2) {
    throw ConfigError(what + ": its parameter '" + e.name + "' has " + std::to_string(e.shape.size()) +
                      " dimensions; a vocabulary table is [vocab, dim]");
  }
  if (fp.config().requires_grad || fp.config().replicated) {
    throw ConfigError(what + ": its parameter '" + e.name + "' " +
                      (fp.config().replicated ? "is replicated (replicate_params)"
                                              : "requires grad; a vocab-parallel table must be frozen (e.g. a LoRA "
                                                "base: apply fsdp::lora before fully_shard)"));
  }
}

namespace {

// How a parameter's shard is stored: a trainable one as its fp32 master; a frozen one as
// FullyShardOptions::frozen_storage says (null: the compute dtype), kParamDtype resolved to a dtype.
FrozenStorage frozen_storage_of(const FrozenStorageFn& fn, const Found& f, at::ScalarType compute) {
  FrozenStorage s = fn ? fn(f.name, f.param) : FrozenStorage::kParamDtype;
  if (f.param.requires_grad()) {
    if (s != FrozenStorage::kParamDtype && s != FrozenStorage::kFloat32) {
      throw ConfigError("fsdp: parameter '" + f.name + "' is trainable (requires_grad) but frozen_storage gives it " +
                        frozen_storage_name(s) +
                        ": only a frozen parameter has a stored form; freeze it (fsdp::lora freezes the "
                        "base) or give trainable parameters param_dtype");
    }
    return FrozenStorage::kFloat32;
  }
  if (s != FrozenStorage::kParamDtype) return s;
  switch (compute) {
    case at::kBFloat16: return FrozenStorage::kBFloat16;
    case at::kHalf: return FrozenStorage::kFloat16;
    case at::kFloat: return FrozenStorage::kFloat32;
    default:
      throw ConfigError("fsdp: frozen parameter '" + f.name + "' computes in " + std::string(c10::toString(compute)) +
                        ", which no frozen storage holds; set FullyShardOptions::frozen_storage");
  }
}

FlatParamEntry entry_of(const Found& f) {
  FlatParamEntry e;
  e.name = f.name;
  e.aliases = f.aliases;
  e.param = f.param;
  return e;
}

}  // namespace

// One flat param per (dtype, requires_grad, optimizer group, frozen storage, replicated or not) of
// the unit's own parameters, in first-seen order.
void ShardedUnit::make_flat_params(const torch::nn::Module& module) {
  NestedOwners nested;
  collect_nested_params(module, "", weak_from_this(), nested, /*top=*/true);
  std::vector<Found> found;
  std::unordered_map<const void*, size_t> index;
  collect_own_params(module, "", /*top=*/true, found, index);

  std::map<std::tuple<int, bool, int, int, bool>, size_t> slot;
  std::vector<std::vector<FlatParamEntry>> groups;
  std::vector<FlatParamConfig> configs;
  const auto& mp = options_.mp_policy;
  for (auto& f : found) {
    const auto owner = nested.find(f.param.unsafeGetTensorImpl());
    if (record_tie(f.name, f.param, owner == nested.end() ? nullptr : owner->second)) continue;
    check_not_owned(f.name, f.param);
    check_param(f);
    const int group = options_.param_group(f.name, f.param);
    const at::ScalarType compute = mp.param_dtype().value_or(f.param.scalar_type());
    const FrozenStorage storage = frozen_storage_of(options_.frozen_storage, f, compute);
    const bool replicated = options_.replicate_params && options_.replicate_params(f.name, f.param);
    const auto key = std::make_tuple(static_cast<int>(f.param.scalar_type()), f.param.requires_grad(), group,
                                     static_cast<int>(storage), replicated);
    auto it = slot.find(key);
    if (it == slot.end()) {
      it = slot.emplace(key, groups.size()).first;
      groups.emplace_back();
      FlatParamConfig c;
      c.compute_dtype = compute;
      c.storage = storage;
      c.reduce_dtype = mp.reduce_dtype().value_or(c.compute_dtype);
      c.requires_grad = f.param.requires_grad();
      c.group = group;
      c.device = mesh_.dist().compute_device();
      c.module_type = module.name();
      c.replicated = replicated;
      configs.push_back(c);
    }
    groups[it->second].push_back(entry_of(f));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    configs[i].tag = "unit/" + std::to_string(i);
    if (configs[i].replicated) {  // whole on every rank: a one-rank shard group, all-reduced over every rank
      if (!no_shard_group_) {
        const int rank = mesh_.dist().rank();
        no_shard_group_ = make_local_group("replicated/" + std::to_string(rank), rank);
      }
      flat_params_.push_back(std::make_unique<FlatParam>(std::move(groups[i]), configs[i], *no_shard_group_,
                                                         mesh_.replicated_params_group()));
    } else {
      flat_params_.push_back(
          std::make_unique<FlatParam>(std::move(groups[i]), configs[i], *shard_group_, *replicate_group_));
      flat_params_.back()->set_post_forward_group(post_forward_group_);
    }
    has_frozen_ = has_frozen_ || !configs[i].requires_grad;
  }
  grads_landed_.assign(flat_params_.size(), 0);
  post_backward_done_.assign(flat_params_.size(), false);
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

// Note [Parameters already sharded]
// Every parameter a unit takes is recorded (by TensorImpl) until the unit is destroyed, so a
// module whose parameters another unit already owns is refused: fully_shard on a child after its
// parent (the parent took the child's parameters) or on a module whose ancestor was sharded.
namespace {
std::mutex owned_mutex;
std::unordered_map<const void*, std::weak_ptr<ShardedUnit>>& owned_params() {
  static auto* owned = new std::unordered_map<const void*, std::weak_ptr<ShardedUnit>>();
  return *owned;
}

std::shared_ptr<ShardedUnit> owner_of(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(owned_mutex);
  auto it = owned_params().find(param.unsafeGetTensorImpl());
  return it == owned_params().end() ? nullptr : it->second.lock();
}
}  // namespace

// A parameter that another unit holds is tied across units when that unit is nested in this one
// or sits beside it (its module does not contain this one); contained, this module is a child
// sharded after its parent, which check_not_owned refuses.
bool ShardedUnit::record_tie(const std::string& name, const at::Tensor& param, ShardedUnit* nested_owner) {
  std::shared_ptr<ShardedUnit> owner = nested_owner ? nested_owner->shared_from_this() : owner_of(param);
  if (!owner) return false;
  if (nested_owner == nullptr) {
    auto owner_module = owner->module_.lock();
    if (!owner_module || path_in(*owner_module, module_.lock().get())) return false;
  }
  std::string owner_name = "?";
  for (auto& fp : owner->flat_params_) {
    for (const auto& e : fp->entries()) {
      if (e.param.is_same(param)) owner_name = e.name;
    }
  }
  tied_.push_back({name, owner, owner_name});
  return true;
}

void ShardedUnit::check_not_owned(const std::string& name, const at::Tensor& param) const {
  auto owner = owner_of(param);
  if (!owner) return;
  auto owner_module = owner->module().lock();
  auto module = module_.lock();
  const auto path = owner_module ? path_in(*owner_module, module.get()) : std::nullopt;
  // Paths from the outermost sharded module: the owner's, then this module's in the owner.
  const std::string owner_path = owner->path_before_root();
  const bool outermost = owner_path == "<root>";
  const std::string here = !path ? "" : outermost ? *path : owner_path + (path->empty() ? "" : "." + *path);
  const std::string param_path = here.empty() ? name : here + "." + name;
  throw ConfigError("fsdp: cannot shard " + (here.empty() ? std::string("this module") : "'" + here + "'") +
                    ": its parameter '" + param_path + "' already belongs to the unit of " +
                    (outermost ? std::string("a module around it") : "'" + owner_path + "'") +
                    ", which was sharded first. Shard bottom-up: the blocks first, their parents after them, the "
                    "root last");
}

void ShardedUnit::record_owned() {
  std::lock_guard<std::mutex> lock(owned_mutex);
  for (auto& fp : flat_params_) {
    for (const auto& e : fp->entries()) owned_params()[e.param.unsafeGetTensorImpl()] = weak_from_this();
  }
}

void ShardedUnit::forget_owned() {
  std::lock_guard<std::mutex> lock(owned_mutex);
  for (auto& fp : flat_params_) {
    for (const auto& e : fp->entries()) {
      auto it = owned_params().find(e.param.unsafeGetTensorImpl());
      if (it != owned_params().end() && (it->second.expired() || it->second.lock().get() == this))
        owned_params().erase(it);
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
      if (policy.params() == OffloadTier::kDisk && !fp->stores_frozen()) disk_bytes += bytes;
      if (policy.grads() == OffloadTier::kDisk && fp->config().requires_grad) disk_bytes += bytes;
    }
  }
  if (rs.disk_tier) rs.disk_tier->check_free_space(disk_bytes, "the offloaded master and gradient shards");
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
