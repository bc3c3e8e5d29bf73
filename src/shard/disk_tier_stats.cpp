// The public view of the disk tier: its figures for the memory report and the residency audit.
#include "fsdp/offload.h"
#include "offload/testing.h"
#include "offload/tier.h"
#include "shard/sharded_unit.h"
#include "shard/testing.h"

namespace fsdp {
namespace {

offload::DiskTier* disk_tier_of(FSDPModule& root) {
  ShardedUnit& unit = unit_of(root);
  if (unit.root() != &unit) unit.lazy_init();
  return unit.root_state().disk_tier.get();
}

}  // namespace

DiskTierStats disk_tier_stats(FSDPModule& root) {
  DiskTierStats s;
  offload::DiskTier* tier = disk_tier_of(root);
  if (tier == nullptr) return s;
  s.dir = tier->dir();
  s.file_bytes = tier->file_bytes();
  s.resident_bytes = tier->resident_bytes();
  s.peak_resident_bytes = tier->peak_resident_bytes();
  s.budget_bytes = tier->budget_bytes();
  try {
    s.chunk_bytes = tier->chunk_elements(3) * static_cast<int64_t>(sizeof(float));
  } catch (const ConfigError&) {
    s.chunk_bytes = 0;  // a budget too small to stream: the step says so when it runs
  }
  return s;
}

void drop_disk_tier_page_cache(FSDPModule& root) {
  if (offload::DiskTier* tier = disk_tier_of(root)) offload::testing::drop_page_cache(*tier);
}

void set_disk_tier_audit(FSDPModule& root, bool on) {
  if (offload::DiskTier* tier = disk_tier_of(root)) offload::testing::set_audit(*tier, on);
}

}  // namespace fsdp
