// See layout.h.
#include "checkpoint/layout.h"

#include <algorithm>

namespace fsdp::checkpoint {
namespace {

// The optimizer state of each of view.flats (same order), null where the optimizer holds none
// (frozen flat params) or when `optimizer` is null. A ShardState carries its flat param's index in the root's order
// (units pre-order, then each unit's flat params), the order the view's flats follow.
std::vector<ShardState*> states_by_flat(const ModelView& view, ShardedOptimizer* optimizer) {
  std::vector<ShardState*> states(view.flats.size(), nullptr);
  if (optimizer == nullptr) return states;
  for (auto& s : optimizer->states()) {
    if (s.flat_index < states.size()) states[s.flat_index] = &s;
  }
  return states;
}

}  // namespace

CheckpointLayout make_layout(const ModelView& model, ShardedOptimizer* optimizer) {
  CheckpointLayout layout;
  const std::vector<ShardState*> states = states_by_flat(model, optimizer);
  for (size_t f = 0; f < model.flats.size(); ++f) layout.flats.push_back({model.flats[f], states[f]});
  layout.tensors = model.tensors;
  layout.buffers = model.buffers;
  return layout;
}

std::optional<Span> shard_span(const FlatShardView& flat, const ShardedTensorView& tensor) {
  const int64_t lo = std::max(flat.shard_offset, tensor.offset);
  const int64_t hi = std::min(flat.shard_offset + flat.shard_numel, tensor.offset + tensor.numel);
  if (lo >= hi) return std::nullopt;
  return Span{lo - tensor.offset, lo - flat.shard_offset, hi - lo};
}

ShardData collect_shards(const CheckpointLayout& layout, bool copy) {
  ShardData data;
  for (const auto& slot : layout.flats) {
    const ShardTensor& p = slot.shard.master;
    // Snapshots stay in their tier: a disk-tier state is copied to a new disk-tier file. A stored
    // frozen shard's values are decoded for its snapshot and freed again.
    const bool lazy = copy && p.defined() && slot.shard.drop_values;
    if (lazy) slot.shard.read_values();
    data.params.push_back(copy && p.defined() ? p.snapshot() : p);  // undefined: frozen, not saved
    if (lazy) slot.shard.drop_values();
    std::map<std::string, ShardTensor> states;
    int64_t step = 0;
    if (slot.optim_state != nullptr) {
      step = slot.optim_state->step;
      for (const auto& [name, t] : slot.optim_state->tensors) {
        if (t.defined()) states[name] = copy ? ShardTensor(t).snapshot() : ShardTensor(t);
      }
    }
    data.states.push_back(std::move(states));
    data.steps.push_back(step);
  }
  // Buffers are small: always a host copy, so a background save sees this step's values.
  for (const auto& b : layout.buffers) {
    data.buffers.push_back(b.tensor.detach().to(at::kCPU, b.dtype, /*non_blocking=*/false, /*copy=*/true).contiguous());
  }
  return data;
}

}  // namespace fsdp::checkpoint
