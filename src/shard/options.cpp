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

const char* frozen_storage_name(FrozenStorage s) {
  switch (s) {
    case FrozenStorage::kParamDtype: return "param_dtype";
    case FrozenStorage::kFloat32: return "float32";
    case FrozenStorage::kBFloat16: return "bfloat16";
    case FrozenStorage::kFloat16: return "float16";
    case FrozenStorage::kInt8: return "int8";
    case FrozenStorage::kNF4: return "nf4";
  }
  return "unknown";
}

FrozenStorage parse_frozen_storage(const std::string& name) {
  for (auto s : {FrozenStorage::kParamDtype, FrozenStorage::kFloat32, FrozenStorage::kBFloat16, FrozenStorage::kFloat16,
                 FrozenStorage::kInt8, FrozenStorage::kNF4}) {
    if (name == frozen_storage_name(s)) return s;
  }
  throw ConfigError("fsdp: unknown frozen storage '" + name +
                    "' (expected param_dtype, float32, bfloat16, float16, int8 or nf4)");
}

int default_param_group(const std::string&, const at::Tensor& param) { return param.dim() < 2 ? 1 : 0; }

}  // namespace fsdp
