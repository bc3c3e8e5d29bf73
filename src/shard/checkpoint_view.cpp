// See checkpoint_view.h.
#include "shard/checkpoint_view.h"

#include <unordered_map>
#include <utility>

#include "shard/flat_param.h"
#include "shard/sharded_unit.h"

namespace fsdp {

ModelView model_view(FSDPModule& root) {
  ModelView view;
  // Tensor identity -> (flat index, entry, the unit's prefix). Units pre-order, then each unit's
  // flat params: the order the optimizer's states and the saved files follow.
  struct Placed {
    size_t flat;
    const FlatParamEntry* entry;
    std::string prefix;
  };
  std::unordered_map<const void*, Placed> by_tensor;
  for (const auto& unit : root.units()) {
    for (auto& fp : unit->flat_params()) {
      const size_t index = view.flats.size();
      view.flats.push_back({&fp->sharded_param(), fp->shard_offset(), fp->shard_numel(), fp->config().requires_grad,
                            fp->config().tag, index});
      for (const auto& e : fp->entries()) by_tensor[e.param.unsafeGetTensorImpl()] = {index, &e, unit->prefix()};
      if (fp->replicate_group().rank() != 0) view.writer = false;
    }
  }
  // The model's own registration order gives files that read like the model.
  auto module = root.unit().module().lock();
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    auto it = by_tensor.find(item.value().unsafeGetTensorImpl());
    if (it == by_tensor.end()) continue;
    const Placed& p = it->second;
    ShardedTensorView t;
    t.name = p.prefix + p.entry->name;
    for (const auto& alias : p.entry->aliases) t.aliases.push_back(p.prefix + alias);
    t.shape = p.entry->shape;
    t.numel = p.entry->numel;
    t.offset = p.entry->offset;
    t.flat = p.flat;
    view.tensors.push_back(std::move(t));
    by_tensor.erase(it);  // tied: once
  }
  view.dist = &root.unit().mesh().dist();
  view.strategy = strategy_name(root.unit().options().strategy());
  return view;
}

// Note [Matching optimizer states to flat params]
// A ShardState names its flat param; the view's flats carry the address of each one's master
// shard, which is unique per flat param, so the match needs nothing else of the model.
std::vector<ShardState*> states_by_flat(const ModelView& view, ShardedOptimizer* optimizer) {
  std::vector<ShardState*> states(view.flats.size(), nullptr);
  if (optimizer == nullptr) return states;
  std::unordered_map<const at::Tensor*, size_t> index_of;
  for (const auto& f : view.flats) index_of[f.master_shard] = f.index;
  for (auto& s : optimizer->states()) {
    auto it = index_of.find(&s.flat->sharded_param());
    if (it != index_of.end()) states[it->second] = &s;
  }
  return states;
}

}  // namespace fsdp
