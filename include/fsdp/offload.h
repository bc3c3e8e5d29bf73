// Offload: where sharded states live between uses, chosen per unit and per state with
// FullyShardOptions::offload (an OffloadPolicy, fsdp/options.h). This header holds the per-rank
// figures offload reports (src/optim/memory.cpp, beside memory_report; its error type,
// OffloadError, is in fsdp/errors.h); the mechanisms are private (src/offload/).
//
//   auto policy = fsdp::OffloadPolicy().params(fsdp::OffloadTier::kDisk)
//                     .optimizer_state(fsdp::OffloadTier::kDisk).dir("/nvme/offload")
//                     .memory_budget_bytes(256 << 20);
//   auto root = fsdp::fully_shard(model, mesh, fsdp::FullyShardOptions().offload(policy));
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/offload_io.h"

namespace fsdp {

// The disk tier's files and what of them is mapped in memory now, for one rank.
struct DiskTierStats {
  std::string dir;
  int64_t file_bytes = 0;           // bytes reserved in files under dir
  int64_t resident_bytes = 0;       // of those, pages mapped in this process now (mincore)
  int64_t peak_resident_bytes = 0;  // the most seen at once by the audit (0 unless audited)
  int64_t budget_bytes = 0;         // OffloadPolicy::memory_budget_bytes
  int64_t chunk_bytes = 0;          // bytes per state tensor per chunk of the streamed step
};

// Figures of the disk tier under `root` (all zero when nothing is offloaded to disk).
DiskTierStats disk_tier_stats(FSDPModule& root);

class ShardedOptimizer;

// What offload will hold and move, per rank, predicted at the start of a run from the flat
// params' sizes and tiers: the bytes each tier holds (params, gradients, optimizer state and the
// master's working copy) and the I/O of one training step in the steady state (after the first,
// whose execution order is not known yet). A step gathers each unit in forward and again in
// backward, except the root and the last unit to run forward, which keep their params from
// forward to backward by default (docs/NOTES.md), and units that do not reshard after forward;
// the same rule as the state machine's (a last unit whose forward runs without gradients, under
// activation checkpointing, gathers again). The forward order and each unit's gradient mode are
// those of the last step run; before the first, registration order and gradients on. The units whose backward comes
// first keep their forward read of a disk-tier master for their backward gather, within half of memory_budget_bytes;
// with the optimizer stepping in backward (ShardedOptimizer::step_in_backward), the step takes a disk-tier master from
// the backward's all-gather instead of reading it again. Gradient shards in the disk tier move through their mapping
// and are not counted.
struct OffloadPlan {
  int64_t device_bytes = 0, host_bytes = 0, disk_bytes = 0;
  OffloadIo per_step;
  std::string to_string() const;
};
OffloadPlan offload_plan(FSDPModule& root, const ShardedOptimizer& optimizer);
// Bytes moved so far (cumulative since the tiers opened): measure a step's as a difference.
OffloadIo offload_io(FSDPModule& root);

}  // namespace fsdp
