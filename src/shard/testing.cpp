// Test and benchmark switches of the disk tier (shard/testing.h): its page cache dropped, its residency audited.
#include "offload/testing.h"
#include "offload/tier_tensors.h"
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

void drop_disk_tier_page_cache(FSDPModule& root) {
  if (offload::DiskTier* tier = disk_tier_of(root)) offload::testing::drop_page_cache(*tier);
}

void set_disk_tier_audit(FSDPModule& root, bool on) {
  if (offload::DiskTier* tier = disk_tier_of(root)) offload::testing::set_audit(*tier, on);
}

}  // namespace fsdp
