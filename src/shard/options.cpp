// Names of sharding strategies and buffer syncs (one table each, base/named.h),
// and the default optimizer grouping.
#include <algorithm>
#include <cctype>

#include "base/named.h"
#include "fsdp/errors.h"
#include "fsdp/options.h"

namespace fsdp {
namespace {

constexpr base::Named<ShardingStrategy> kStrategies[] = {
    {ShardingStrategy::kFullShard, "FULL_SHARD"},
    {ShardingStrategy::kShardGradOp, "SHARD_GRAD_OP"},
    {ShardingStrategy::kNoShard, "NO_SHARD"},
    {ShardingStrategy::kHybridShard, "HYBRID_SHARD"},
};

constexpr base::Named<BufferSync> kBufferSyncs[] = {
    {BufferSync::kBroadcast, "broadcast"},
    {BufferSync::kAverage, "average"},
    {BufferSync::kLocal, "local"},
};

}  // namespace

const char* strategy_name(ShardingStrategy s) { return base::name_of(kStrategies, s, "UNKNOWN"); }

ShardingStrategy parse_strategy(const std::string& name) {
  std::string up = name;
  std::transform(up.begin(), up.end(), up.begin(), [](unsigned char c) { return std::toupper(c); });
  if (auto s = base::value_of(kStrategies, up)) return *s;
  throw ConfigError("fsdp: unknown sharding strategy '" + name + "' (expected " + base::names_text(kStrategies) + ")");
}

const char* buffer_sync_name(BufferSync s) { return base::name_of(kBufferSyncs, s, "unknown"); }

int default_param_group(const std::string&, const at::Tensor& param) { return param.dim() < 2 ? 1 : 0; }

}  // namespace fsdp
