// What the checkpoint layer sees of a sharded model: every parameter by name in the model's own
// order, where it sits in its flat param, and this rank's part of each flat param (its live fp32
// master shard and the flat elements it covers). Values only, apart from the master shard: the
// layout a checkpoint's files take is computed from this alone, so every rank (and every world
// size) agrees on it, and the checkpoint layer never reads ShardedUnit or FlatParam.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/dist.h"
#include "fsdp/fully_shard.h"

namespace fsdp {

// One parameter, tied ones once: a full tensor of the checkpoint's files.
struct ShardedTensorView {
  std::string name;                  // fully qualified, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<std::string> aliases;  // its other fully qualified names (tied weights)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // first element in its flat param (unpadded flat layout)
  size_t flat = 0;     // index into ModelView::flats
};

// This rank's shard of one flat param: flat elements [shard_offset, shard_offset + shard_numel).
struct FlatShardView {
  // The live fp32 master shard (FlatParam::sharded_param()). Copies into it land in the model; a
  // view is short-lived (one save or load), so the pointer never outlives the model.
  at::Tensor* master_shard = nullptr;
  int64_t shard_offset = 0;
  int64_t shard_numel = 0;
  bool requires_grad = true;
  std::string tag;  // "layers.0/0", as in collective errors
  // To call after writing into master_shard (a load): refreshes what the model derives from it.
  std::function<void()> master_written;
  size_t index = 0;  // position in the root's flat-param order (units pre-order, then each unit's)
};

// A persistent buffer (FullyShardOptions::buffers): replicated, saved whole by the job's rank 0.
struct BufferView {
  std::string name;                   // fully qualified, e.g. "1.running_mean"
  at::Tensor tensor;                  // the live buffer; copies into it land in the model
  at::ScalarType dtype = at::kFloat;  // the dtype checkpoints hold it in
};

struct ModelView {
  std::vector<FlatShardView> flats;        // the root's flat-param order
  std::vector<ShardedTensorView> tensors;  // model registration order, tied tensors once
  std::vector<BufferView> buffers;         // after the parameters in the model file
  bool writer = true;                      // replicas of a shard (HSDP, NO_SHARD): only the first writes
  Dist* dist = nullptr;                    // the job the model is sharded over
  std::string strategy;                    // the root's sharding strategy, e.g. "FULL_SHARD"
};

// The view of `root` (lazily initialising it first).
ModelView model_view(FSDPModule& root);

}  // namespace fsdp
