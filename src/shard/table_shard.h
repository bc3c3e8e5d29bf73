// A frozen table's shard, read where it is: the narrow view the vocab-parallel tables
// (src/vocab, fsdp/vocab_parallel.h) compute on instead of gathering the table. Read-only: its
// holder sees the table's one parameter's place in the flat buffer, this rank's shard of it, the
// shard group and the unit's compute dtype and device; nothing of the flat param's gather,
// gradient or tiers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "fsdp/comm.h"

namespace fsdp {
class FlatParam;
class ShardedUnit;

class TableShard {
 public:
  // The table of `module`, a unit sharded with FullyShardOptions::vocab_parallel; nullopt when the
  // module is not sharded. UsageError, naming `fn` and the module, when it is sharded without
  // vocab_parallel, used before its root's lazy init, or inside an fsdp::Join.
  static std::optional<TableShard> of(const torch::nn::Module& module, const char* fn);

  Communicator& group() const;
  const std::string& tag() const;             // the unit's, for collective errors
  at::ScalarType compute_dtype() const;       // the unit's param_dtype
  c10::Device device() const;                 // the compute device
  const std::vector<int64_t>& shape() const;  // the table's [rows, cols]
  int64_t offset() const;                     // the table's first element in the flat buffer
  int64_t shard_numel() const;                // elements of this rank's shard
  int64_t shard_offset() const;               // the flat element this rank's shard starts at
  // Calls `fn` with this rank's shard (shard_numel() elements) read from its tier: in its
  // floating stored dtype, or decoded whole into the compute dtype from int8 or NF4 blocks.
  void with_values(const std::function<void(const at::Tensor&)>& fn) const;

 private:
  TableShard(std::shared_ptr<ShardedUnit> unit, FlatParam* fp) : unit_(std::move(unit)), fp_(fp) {}
  std::shared_ptr<ShardedUnit> unit_;  // keeps the flat param alive (a backward holds a copy)
  FlatParam* fp_ = nullptr;
};

}  // namespace fsdp
