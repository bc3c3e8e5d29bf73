// Introspection and switches for tests and benchmarks: the units and flat params behind a public handle, which
// the public API keeps opaque. Not installed; library code uses sharded_unit.h directly.
#pragma once

#include <vector>

#include "fsdp/fully_shard.h"
#include "flat/flat_param.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"

namespace fsdp::testing {

// The handle's own unit.
inline ShardedUnit& unit(const FSDPModule& handle) { return unit_of(handle); }
// Waits for the writes the last optimizer step left draining into the disk tier, so that what is
// read straight from the shards' mappings is current (the library's own readers wait too).
inline void settle_disk_writes(const FSDPModule& handle) {
  ShardedUnit& u = unit_of(handle);
  if (u.root() != nullptr && u.root_state().disk_tier) u.root_state().disk_tier->flush();
}
// The handle's unit and every unit nested under it, pre-order; lazy-initialises an unclaimed root
// (materialises deferred-init shards). Settles the disk tier's writes first.
inline std::vector<ShardedUnit*> units(const FSDPModule& handle) {
  auto out = units_of(handle);
  settle_disk_writes(handle);
  return out;
}
// Their flat params in order: ShardState::flat_index indexes this.
inline std::vector<FlatParam*> flat_params(const FSDPModule& handle) {
  auto out = flat_params_of(handle);
  settle_disk_writes(handle);
  return out;
}

}  // namespace fsdp::testing

namespace fsdp {
// Switches for tests and benchmarks, kept out of the installed headers (src/shard/testing.cpp).
// Measures the mapped resident set after every chunk of the streamed optimizer step and after
// each all-gather reads a disk-tier shard, keeping the peak in DiskTierStats (costs a mincore
// per mapping each time).
void set_disk_tier_audit(FSDPModule& root, bool on);
// Drops the page cache of the disk tier's files, so that what it reads next comes from the disk
// (queued writes go on: they bypass the cache or leave it after themselves).
void drop_disk_tier_page_cache(FSDPModule& root);
}  // namespace fsdp
