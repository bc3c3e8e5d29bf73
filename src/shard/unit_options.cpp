// A unit's options resolved: what fully_shard's FullyShardOptions say against the mesh (the
// strategy, resharding after forward and its group, mixed precision), and what a unit leaves unset
// taken from its root's at lazy init. See sharded_unit.h and shard/resolved_options.h.
#include <optional>
#include <string>

#include "fsdp/errors.h"
#include "offload/placement.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace {

// The strategy's mesh: FULL_SHARD and SHARD_GRAD_OP shard over every rank of a 1-D mesh, and
// HYBRID_SHARD needs rows to replicate across. A 2-D mesh with FULL_SHARD used to shard within a
// row and replicate across rows, which is HYBRID_SHARD under another name: refused rather than
// guessed, so that a config says what it does.
void check_strategy_fits_mesh(ShardingStrategy strategy, const DeviceMesh& mesh) {
  const std::string shape =
      "replicate_size=" + std::to_string(mesh.replicate_size()) + ", shard_size=" + std::to_string(mesh.shard_size());
  switch (strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (mesh.is_hybrid()) {
        throw ConfigError(std::string("fsdp: ") + strategy_name(strategy) +
                          " needs a 1-D mesh, but this mesh is 2-D (" + shape +
                          "): use HYBRID_SHARD to shard within rows and replicate across them, or a 1-D "
                          "DeviceMesh(dist) to shard over every rank");
      }
      break;
    case ShardingStrategy::kHybridShard:
      if (!mesh.is_hybrid()) {
        throw ConfigError(
            "fsdp: HYBRID_SHARD needs a 2-D mesh with more than one replica: build it with "
            "DeviceMesh(dist, replicate_size, shard_size); this mesh has " +
            shape);
      }
      break;
    case ShardingStrategy::kNoShard: break;
  }
}

void check_floating(const char* field, const std::optional<at::ScalarType>& dtype) {
  if (dtype && !at::isFloatingType(*dtype)) {
    throw ConfigError(std::string("fsdp: ") + field + " must be a floating type, got " +
                      std::string(c10::toString(*dtype)));
  }
}

}  // namespace

ResolvedOptions resolve_unit_options(const FullyShardOptions& options, const DeviceMesh& mesh) {
  ResolvedOptions r;
  r.strategy = options.strategy();
  check_strategy_fits_mesh(r.strategy, mesh);
  resolve_reshard_after_forward(options, mesh.shard_size(), r);
  r.replicate_params = r.strategy == ShardingStrategy::kNoShard ? nullptr : options.replicate_params();
  r.mp_policy = options.mp_policy();
  check_floating("param_dtype", r.mp_policy.param_dtype());
  check_floating("reduce_dtype", r.mp_policy.reduce_dtype());
  r.param_group = options.param_group();
  r.init = options.init();
  r.frozen_storage = options.frozen_storage();
  r.vocab_parallel = options.vocab_parallel();
  return r;
}

// Every unit under the root, once the root is known: what a unit leaves unset comes from the
// root's options. Runs again if a larger root claims units that lazy-initialised on their own.
void ShardedUnit::resolve_inherited_options() {
  const c10::Device device = mesh_.dist().compute_device();
  for (ShardedUnit* unit : root_state_->units) {
    const FullyShardOptions& own = unit->requested_;
    ResolvedOptions& o = unit->options_;
    o.prefetch_depth = own.prefetch_depth().value_or(requested_.prefetch_depth().value_or(1));
    o.max_unsharded_units = requested_.max_unsharded_units();
    o.offload = own.offload() ? *own.offload() : requested_.offload().value_or(OffloadPolicy());
    o.offload.validate();
    offload::check_allowed_on_device(o.offload, unit->name(), device.is_cpu(), device.str());
  }
}

}  // namespace fsdp
