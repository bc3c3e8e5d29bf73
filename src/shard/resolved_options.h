// ResolvedOptions: the options a unit runs with. FullyShardOptions says what the user asked for,
// with unset fields that fall back to the root's or to a default; each field is resolved once,
// here, and the rest of the shard core reads only this struct.
#pragma once

#include <string>

#include "fsdp/device_mesh.h"
#include "fsdp/options.h"

namespace fsdp {

// | field                                  | scope                                        | resolved at          |
// |----------------------------------------|----------------------------------------------|----------------------|
// | strategy                               | per unit                                     | fully_shard          |
// | reshard_after_forward (+ _explicit)    | per unit (unset: true for FULL_SHARD and     | fully_shard          |
// |                                        | HYBRID_SHARD, else false; NO_SHARD: false)   |                      |
// | reshard_after_forward_group            | per unit (0: none; 1 and the shard size      | fully_shard          |
// |                                        | become reshard_after_forward false and true) |                      |
// | replicate_params                       | per unit (ignored under NO_SHARD)            | fully_shard          |
// | mp_policy                              | per unit                                     | fully_shard          |
// | param_group                            | per unit                                     | fully_shard          |
// | init                                   | per unit                                     | fully_shard          |
// | frozen_storage                         | per unit (null: the compute dtype)           | fully_shard          |
// | vocab_parallel                         | per unit                                     | fully_shard          |
// | prefetch_depth                         | inherited: own, else the root's, else 1      | the root's lazy init |
// | offload                                | inherited: own, else the root's, else none;  | the root's lazy init |
// |                                        | validated there                              |                      |
// | max_unsharded_units                    | root only (the root's, copied to every unit) | the root's lazy init |
//
// fully_shard is resolve_unit_options (the fields a unit needs to build its flat params, and the
// checks of strategy against mesh and of the dtypes); the root's lazy init is
// ShardedUnit::resolve_inherited_options (every unit under the root, in one place).
struct ResolvedOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool reshard_after_forward = true;
  // Set explicitly by the user: Note [The last unit keeps its params] guesses only when it was not.
  bool reshard_after_forward_explicit = false;
  // Note [Resharding to a group] (sharded_unit.cpp): 0, or a divisor of the shard size between 1 and it.
  int reshard_after_forward_group = 0;
  ParamPredicate replicate_params;
  MixedPrecisionPolicy mp_policy;
  ParamGroupFn param_group = default_param_group;
  ParamInitFn init;
  FrozenStorageFn frozen_storage;
  bool vocab_parallel = false;
  int prefetch_depth = 1;
  OffloadPolicy offload;
  int max_unsharded_units = 0;
};

// The per-unit fields of `options` (inherited and root-only ones keep their defaults until the
// root's lazy init). Throws ConfigError for a strategy that does not fit `mesh` or a
// non-floating mixed-precision dtype.
ResolvedOptions resolve_unit_options(const FullyShardOptions& options, const DeviceMesh& mesh);
// Sets r's reshard_after_forward, its _explicit and reshard_after_forward_group from `options` (its
// strategy included) for a shard group of `shard_size` ranks; throws ConfigError, the message
// starting with `who`, for a group size it cannot use. The planner resolves by it too (reshard_rules.cpp).
void resolve_reshard_after_forward(const FullyShardOptions& options, int shard_size, ResolvedOptions& r,
                                   const std::string& who = "fsdp");

}  // namespace fsdp
