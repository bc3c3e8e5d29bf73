// Tied parameters across units, and module paths for errors raised before the root is known.
//
// Note [Tied parameters across units]
// A tied parameter (one tensor registered in two modules, e.g. an embedding reused as the output
// projection) is gathered, reduced and stepped once, by the unit that holds it; every module that
// uses it must belong to that unit. When fully_shard meets a parameter another unit already holds
// (a unit nested in this one, or one sharded earlier beside it), it cannot name the parameter by
// its paths yet: the root, which fixes them, is sharded last. So the unit leaves the parameter to
// its holder and records the tie, and the root's lazy init (the first fsdp::call on the root, or
// the first optimizer built over it), before it changes anything, refuses the model with
// ConfigError naming the parameter's path in both units and the unit to make instead: their
// common parent. A child sharded after its parent is a different mistake (check_not_owned). The
// exception is a tie to a vocab-parallel table (FullyShardOptions::vocab_parallel), which is never
// gathered: a tied head outside its unit computes on its shards (fsdp/vocab_parallel.h).
#include <torch/nn/module.h>

#include <optional>
#include <unordered_map>

#include "fsdp/errors.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace {

// `inner`'s path in `outer`'s module tree ("" for outer itself), if it is there.
std::optional<std::string> path_in(const torch::nn::Module& outer, const torch::nn::Module* inner) {
  for (const auto& item : outer.named_modules("", /*include_self=*/true)) {
    if (item.value().get() == inner) return item.key();
  }
  return std::nullopt;
}

std::string unit_display(const std::string& path) { return path.empty() ? "<root>" : path; }

std::string join(const std::string& unit_path, const std::string& name) {
  return unit_path.empty() ? name : unit_path + "." + name;
}

// The longest common dotted prefix of two module paths ("" is the root).
std::string common_parent(const std::string& a, const std::string& b) {
  size_t end = 0;
  for (size_t i = 0; i <= a.size() && i <= b.size(); ++i) {
    const bool a_end = i == a.size() || a[i] == '.';
    const bool b_end = i == b.size() || b[i] == '.';
    if (a_end && b_end) end = i;
    if (i == a.size() || i == b.size() || a[i] != b[i]) break;
  }
  return a.substr(0, end);
}

std::string tie_message(const std::string& unit, const std::string& name, const std::string* owner_unit,
                        const std::string& owner_name) {
  std::string msg = "fsdp: parameter '" + join(unit, name) + "' (unit '" + unit_display(unit) + "') is the same tensor";
  if (owner_unit == nullptr) {
    return msg + " as '" + owner_name +
           "' of a unit outside this model: a tied parameter cannot be split across sharded units. Put every "
           "user of a tied parameter in one unit: shard their common parent as one unit";
  }
  const std::string parent = common_parent(unit, *owner_unit);
  std::string apart;
  for (const std::string* u : {&unit, owner_unit}) {
    if (*u == parent) continue;
    apart += (apart.empty() ? "'" : " and '") + *u + "'";
  }
  return msg + " as '" + join(*owner_unit, owner_name) + "' (unit '" + unit_display(*owner_unit) +
         "'): a tied parameter cannot be split across sharded units, which would each gather, reduce and step "
         "their own copy of it. Put every user of a tied parameter in one unit: shard their common parent '" +
         unit_display(parent) + "' as one unit, and not " + apart +
         " on its own (fully_shard the blocks that do not share it, then the parent)";
}

}  // namespace

void ShardedUnit::check_no_ties() const {
  auto module = module_.lock();
  if (!module) return;
  std::unordered_map<const ShardedUnit*, std::string> path;
  std::vector<const ShardedUnit*> units;
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    if (const ShardedUnit* unit = detail::unit_of(*item.value())) {
      path.emplace(unit, item.key());
      units.push_back(unit);
    }
  }
  for (const ShardedUnit* unit : units) {
    for (const TiedParam& tie : unit->tied_) {
      auto owner = tie.owner.lock();
      // A vocab-parallel table is never gathered: its other users reach it through
      // fsdp/vocab_parallel.h's functions, which compute on the owner's shards.
      if (owner && owner->options_.vocab_parallel) continue;
      auto it = owner ? path.find(owner.get()) : path.end();
      throw ConfigError(tie_message(path.at(unit), tie.name, it == path.end() ? nullptr : &it->second, tie.owner_name));
    }
  }
}

std::string ShardedUnit::path_before_root() const {
  if (root_ != nullptr) return name();
  auto enclosing = enclosing_.lock();
  if (!enclosing) return "<root>";
  const std::string outer = enclosing->path_before_root();
  return outer == "<root>" ? path_in_enclosing_ : outer + "." + path_in_enclosing_;
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

}  // namespace fsdp
