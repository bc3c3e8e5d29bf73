// See layout.h.
#include "checkpoint/layout.h"

#include <unordered_map>

#include "tiers/disk_tier.h"
#include "shard/sharded_unit.h"

namespace fsdp::checkpoint {

CheckpointLayout make_layout(FSDPModule& root, ShardedOptimizer* optimizer) {
  CheckpointLayout layout;
  std::unordered_map<size_t, ShardState*> state_of;  // by flat index, the order below
  if (optimizer != nullptr) {
    for (auto& s : optimizer->states()) state_of[s.flat_index] = &s;
  }
  std::unordered_map<const void*, std::pair<size_t, const FlatParamEntry*>> by_tensor;
  std::unordered_map<const void*, std::string> name_of;
  for (ShardedUnit* unit : units_of(root)) {
    for (auto& fp : unit->flat_params()) {
      const size_t index = layout.flats.size();
      auto it = state_of.find(index);
      layout.flats.push_back({fp.get(), it == state_of.end() ? nullptr : it->second});
      for (const auto& e : fp->entries()) {
        by_tensor[e.param.unsafeGetTensorImpl()] = {index, &e};
        name_of[e.param.unsafeGetTensorImpl()] = unit->prefix() + e.name;
      }
      if (fp->replicate_group().rank() != 0) layout.writer = false;
    }
  }
  // The model's own registration order gives files that read like the model.
  auto module = unit_of(root).module().lock();
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const void* key = item.value().unsafeGetTensorImpl();
    auto it = by_tensor.find(key);
    if (it == by_tensor.end()) continue;
    layout.tensors.push_back({name_of.at(key), it->second.first, it->second.second});
    by_tensor.erase(it);  // tied: once
  }
  return layout;
}

std::optional<Span> shard_span(const FlatParam& flat, const FlatParamEntry& entry) {
  const int64_t lo = std::max(flat.shard_offset(), entry.offset);
  const int64_t hi = std::min(flat.shard_offset() + flat.shard_numel(), entry.offset + entry.numel);
  if (lo >= hi) return std::nullopt;
  return Span{lo - entry.offset, lo - flat.shard_offset(), hi - lo};
}

ShardData collect_shards(const CheckpointLayout& layout, bool copy) {
  ShardData data;
  for (const auto& slot : layout.flats) {
    at::Tensor p = slot.flat->sharded_param();
    // Snapshots stay in their tier: a disk-tier state is copied to a new disk-tier file.
    data.params.push_back(copy ? offload::clone_in_tier(p) : p);
    std::map<std::string, at::Tensor> states;
    int64_t step = 0;
    if (slot.optim_state != nullptr) {
      step = slot.optim_state->step;
      for (const auto& [name, t] : slot.optim_state->tensors) {
        if (t.defined()) states[name] = copy ? offload::clone_in_tier(t) : t;
      }
    }
    data.states.push_back(std::move(states));
    data.steps.push_back(step);
  }
  return data;
}

}  // namespace fsdp::checkpoint
