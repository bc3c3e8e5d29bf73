// Per-rank memory by category for a sharded model, measured from the buffers themselves.
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/fully_shard.h"

namespace fsdp {

class ShardedOptimizer;

struct MemoryReport {
  int64_t sharded_params = 0;        // fp32 master shards
  int64_t sharded_grads = 0;         // fp32 gradient shards
  int64_t optimizer_state = 0;       // e.g. AdamW exp_avg + exp_avg_sq shards
  int64_t unsharded_alive = 0;       // gathered param and gradient buffers alive now
  int64_t peak_unsharded = 0;        // the most gathered bytes alive at once so far
  int64_t model_state() const { return sharded_params + sharded_grads + optimizer_state; }
  std::string to_string() const;
};

MemoryReport memory_report(FSDPModule& root, const ShardedOptimizer* optimizer = nullptr);

}  // namespace fsdp
