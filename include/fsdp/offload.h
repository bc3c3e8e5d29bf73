// Offload: where sharded states live between uses, chosen per unit and per state with
// FullyShardOptions::offload (an OffloadPolicy, fsdp/options.h). This header holds the per-rank
// figures the disk tier reports (its error type, OffloadError, is in fsdp/errors.h); the
// mechanisms are private (src/tiers/).
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
// Measures the mapped resident set after every chunk of the streamed optimizer step and after
// each all-gather reads a disk-tier shard, keeping the peak in DiskTierStats (costs a mincore
// per mapping each time; for tests and benchmarks).
void set_disk_tier_audit(FSDPModule& root, bool on);

}  // namespace fsdp
