// What a unit frees after its forward, resolved from its options: the one rule that fully_shard
// (resolve_unit_options) and the planner (src/plan/plan_cost.cpp) both apply, so the planner refuses
// the group sizes fully_shard refuses and counts the gathers it runs (tests/threads/forward_rules_test.cpp).
// Which units then keep their params from forward to backward is prefetch::keeps_params_after_forward.
#include "fsdp/errors.h"
#include "shard/resolved_options.h"

namespace fsdp {

// FullyShardOptions::reshard_after_forward_group: 1 and the shard group's size are the bool modes;
// any other size must divide the shard group and find the params resharded after forward.
void resolve_reshard_after_forward(const FullyShardOptions& options, int shard_size, ResolvedOptions& r,
                                   const std::string& who) {
  const ShardingStrategy s = options.strategy();
  r.reshard_after_forward_explicit = options.reshard_after_forward().has_value();
  r.reshard_after_forward = s != ShardingStrategy::kNoShard &&  // NO_SHARD: nothing to free
                            options.reshard_after_forward().value_or(s == ShardingStrategy::kFullShard ||
                                                                     s == ShardingStrategy::kHybridShard);
  const int k = options.reshard_after_forward_group();
  if (k == 0) return;
  const std::string what = who + ": reshard_after_forward_group=" + std::to_string(k);
  if (k < 0) throw ConfigError(what + ": must be 0 (off) or a number of ranks");
  if (s == ShardingStrategy::kNoShard) {
    throw ConfigError(what + " with NO_SHARD: every rank keeps every parameter, there is nothing to reshard");
  }
  if (options.reshard_after_forward() == std::optional<bool>(false) && k > 1) {
    throw ConfigError(what +
                      " with reshard_after_forward false: the group size says how to reshard after "
                      "forward; leave reshard_after_forward unset or true");
  }
  if (shard_size % k != 0) {
    throw ConfigError(what + " does not divide the shard group of " + std::to_string(shard_size) +
                      " ranks: give a divisor of it (e.g. the ranks of one node)");
  }
  r.reshard_after_forward_explicit = true;
  r.reshard_after_forward = k > 1;
  if (k > 1 && k < shard_size) r.reshard_after_forward_group = k;
}

}  // namespace fsdp
