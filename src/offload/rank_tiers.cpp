// open_rank_tiers (rank_tiers.h).
#include "offload/rank_tiers.h"

#include "fsdp/errors.h"
#include "offload/device_stager.h"
#include "offload/placement.h"
#include "offload/tier.h"

namespace fsdp::offload {

RankTiers open_rank_tiers(const std::vector<std::pair<std::string, const OffloadPolicy*>>& units, c10::Device device) {
  RankTiers t;
  const OffloadPolicy* disk_policy = nullptr;
  bool stager = false;
  for (const auto& [name, policy] : units) {
    stager = stager || needs_stager(*policy, device.is_cpu());
    if (!policy->uses(OffloadTier::kDisk)) continue;
    if (disk_policy &&
        (disk_policy->dir() != policy->dir() || disk_policy->memory_budget_bytes() != policy->memory_budget_bytes())) {
      throw ConfigError("fsdp: unit '" + name + "' sets offload.dir=" + policy->dir() +
                        " and offload.memory_budget_bytes=" + std::to_string(policy->memory_budget_bytes()) +
                        " but another unit set " + disk_policy->dir() + " and " +
                        std::to_string(disk_policy->memory_budget_bytes()) +
                        "; the disk tier is one per rank: set them on the root only");
    }
    disk_policy = policy;
  }
  if (disk_policy) t.disk = DiskTier::open(disk_policy->dir(), disk_policy->memory_budget_bytes());
  // The stager copies host-tier states (on CPU runs too: Note [Host tier schedule]) and, on a
  // device, disk-tier states between host and device memory.
  if (stager) t.stager = make_stager(device);
  // On a device, the tier's host buffers are pinned: its reads go straight to the device by DMA.
  if (t.disk && t.stager && !device.is_cpu()) {
    t.disk->set_host_allocator([s = t.stager](int64_t numel) { return s->host_zeros(numel); });
  }
  return t;
}

}  // namespace fsdp::offload
