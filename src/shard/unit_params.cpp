// A unit's parameters: which it takes (its own, not a nested unit's; a tied one once), what each
// is checked for, and the flat params built from them by (dtype, requires_grad, optimizer group),
// each frozen one with its stored form. See sharded_unit.h.
#include <ATen/ATen.h>

#include <map>
#include <tuple>
#include <unordered_map>

#include "comm/local_group.h"
#include "fsdp/errors.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace {

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
    if (child.key() == detail::kUnitAnchorName) continue;
    collect_nested_params(*child.value(), path.empty() ? child.key() : path + "." + child.key(), enclosing, out, false);
  }
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
    if (child.key() == detail::kUnitAnchorName) continue;
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

}  // namespace

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
      flat_params_.back()->gathered().set_post_forward_group(post_forward_group_);
    }
    has_frozen_ = has_frozen_ || !configs[i].requires_grad;
  }
  grads_landed_.assign(flat_params_.size(), 0);
  post_backward_done_.assign(flat_params_.size(), false);
}

}  // namespace fsdp
