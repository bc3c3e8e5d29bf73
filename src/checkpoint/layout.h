// The checkpoint's view of a sharded model: every parameter by name, in the model's order, with
// the flat param and shard that hold it. Computed from the model alone, so every rank (and every
// world size) agrees on the files' layout; each rank then knows which byte ranges are its own.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/fully_shard.h"
#include "fsdp/optim.h"
#include "shard/flat_param.h"

namespace fsdp::checkpoint {

struct TensorSlot {
  std::string name;        // fully qualified, e.g. "model.layers.0.mlp.up_proj.weight"
  size_t flat = 0;         // index into CheckpointLayout::flats
  const FlatParamEntry* entry = nullptr;
};

struct FlatSlot {
  FlatParam* flat = nullptr;
  ShardState* optim_state = nullptr;  // null when frozen or without an optimizer
};

// The part of one tensor held in this rank's shard: `count` elements starting at element
// `tensor_begin` of the tensor and at element `shard_begin` of the shard.
struct Span {
  int64_t tensor_begin = 0;
  int64_t shard_begin = 0;
  int64_t count = 0;
};

struct CheckpointLayout {
  std::vector<FlatSlot> flats;
  std::vector<TensorSlot> tensors;  // model registration order, tied tensors once
  bool writer = true;               // replicas of a shard (HSDP, NO_SHARD): only the first writes
};

CheckpointLayout make_layout(FSDPModule& root, ShardedOptimizer* optimizer);
std::optional<Span> shard_span(const FlatParam& flat, const FlatParamEntry& entry);

// A snapshot of this rank's shards: the master params and each optimizer state, per flat slot.
struct ShardData {
  std::vector<at::Tensor> params;
  std::vector<std::map<std::string, at::Tensor>> states;
  std::vector<int64_t> steps;
};
// References to the live tensors (no copy) or, with copy = true, host copies for a background save.
ShardData collect_shards(const CheckpointLayout& layout, bool copy);

}  // namespace fsdp::checkpoint
