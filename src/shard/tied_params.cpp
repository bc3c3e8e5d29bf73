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

#include <unordered_map>

#include "fsdp/errors.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace {

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

}  // namespace fsdp
