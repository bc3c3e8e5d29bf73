// The checkpoint's layout of a sharded model: the model's view (every parameter by name, in the
// model's order, with the flat param and shard that hold it; shard/checkpoint_view.h) and the
// optimizer state of each flat param. Computed from the model alone, so every rank (and every
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
#include "shard/checkpoint_view.h"

namespace fsdp::checkpoint {

struct FlatSlot {
  FlatShardView shard;
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
  std::vector<ShardedTensorView> tensors;  // model registration order, tied tensors once
  std::vector<BufferView> buffers;         // persistent buffers, saved whole by rank 0
};

CheckpointLayout make_layout(const ModelView& model, ShardedOptimizer* optimizer);
std::optional<Span> shard_span(const FlatShardView& flat, const ShardedTensorView& tensor);

// A snapshot of this rank's shards: the master params and each optimizer state, per flat slot.
struct ShardData {
  std::vector<ShardTensor> params;
  std::vector<std::map<std::string, ShardTensor>> states;
  std::vector<int64_t> steps;
  std::vector<at::Tensor> buffers;  // host copies in their saved dtype, contiguous (layout.buffers order)
};
// References to the live tensors (no copy) or, with copy = true, host copies for a background save.
ShardData collect_shards(const CheckpointLayout& layout, bool copy);

}  // namespace fsdp::checkpoint
