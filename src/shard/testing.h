// Introspection and switches for tests and benchmarks: the units and flat params behind a public handle, which
// the public API keeps opaque. Not installed; library code uses sharded_unit.h directly.
#pragma once

#include <vector>

#include "fsdp/fully_shard.h"
#include "shard/flat_param.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"

namespace fsdp::testing {

// The handle's own unit.
inline ShardedUnit& unit(const FSDPModule& handle) { return unit_of(handle); }
// The handle's unit and every unit nested under it, pre-order; lazy-initialises an unclaimed root
// (materialises deferred-init shards).
inline std::vector<ShardedUnit*> units(const FSDPModule& handle) { return units_of(handle); }
// Their flat params in order: ShardState::flat_index indexes this.
inline std::vector<FlatParam*> flat_params(const FSDPModule& handle) { return flat_params_of(handle); }

}  // namespace fsdp::testing

namespace fsdp {
// Switches for tests and benchmarks, kept out of the installed headers (src/shard/disk_tier_stats.cpp).
// Measures the mapped resident set after every chunk of the streamed optimizer step and after
// each all-gather reads a disk-tier shard, keeping the peak in DiskTierStats (costs a mincore
// per mapping each time).
void set_disk_tier_audit(FSDPModule& root, bool on);
// Drops the page cache of the disk tier's files (after waiting for its queued writes), so that
// what it reads next comes from the disk.
void drop_disk_tier_page_cache(FSDPModule& root);
}  // namespace fsdp
