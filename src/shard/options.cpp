// Names of sharding strategies and offload tiers, offload policy validation, and the default
// optimizer grouping.
#include <algorithm>
#include <cctype>

#include "fsdp/errors.h"
#include "fsdp/options.h"

namespace fsdp {

const char* strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "UNKNOWN";
}

ShardingStrategy parse_strategy(const std::string& name) {
  std::string up = name;
  std::transform(up.begin(), up.end(), up.begin(), [](unsigned char c) { return std::toupper(c); });
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                 ShardingStrategy::kHybridShard}) {
    if (up == strategy_name(s)) return s;
  }
  throw ConfigError("fsdp: unknown sharding strategy '" + name +
                    "' (expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD)");
}

const char* offload_tier_name(OffloadTier t) {
  switch (t) {
    case OffloadTier::kNone: return "none";
    case OffloadTier::kHost: return "host";
    case OffloadTier::kDisk: return "disk";
  }
  return "unknown";
}

OffloadTier parse_offload_tier(const std::string& name) {
  for (auto t : {OffloadTier::kNone, OffloadTier::kHost, OffloadTier::kDisk}) {
    if (name == offload_tier_name(t)) return t;
  }
  throw ConfigError("fsdp: unknown offload tier '" + name + "' (expected none, host or disk)");
}

const char* buffer_sync_name(BufferSync s) {
  switch (s) {
    case BufferSync::kBroadcast: return "broadcast";
    case BufferSync::kAverage: return "average";
    case BufferSync::kLocal: return "local";
  }
  return "unknown";
}

BufferSync parse_buffer_sync(const std::string& name) {
  for (auto s : {BufferSync::kBroadcast, BufferSync::kAverage, BufferSync::kLocal}) {
    if (name == buffer_sync_name(s)) return s;
  }
  throw ConfigError("fsdp: unknown buffer sync '" + name + "' (expected broadcast, average or local)");
}

void OffloadPolicy::validate() const {
  if (uses(OffloadTier::kDisk) && dir_.empty()) {
    throw ConfigError("fsdp: offload.dir is empty but a state is offloaded to \"disk\" (params=" +
                      std::string(offload_tier_name(params_)) + ", grads=" + offload_tier_name(grads_) +
                      ", optimizer_state=" + offload_tier_name(optimizer_state_) + "); name a directory");
  }
  if (memory_budget_bytes_ < 0) {
    throw ConfigError("fsdp: offload.memory_budget_bytes=" + std::to_string(memory_budget_bytes_) + " must be >= 0");
  }
}

int default_param_group(const std::string&, const at::Tensor& param) { return param.dim() < 2 ? 1 : 0; }

}  // namespace fsdp
