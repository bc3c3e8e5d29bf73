// The tiers of one rank: one disk tier and one host stager, shared by every unit (null when unused).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "fsdp/offload_policy.h"

namespace fsdp::offload {

class DiskTier;
class DeviceStager;

struct RankTiers {
  std::shared_ptr<DiskTier> disk;
  std::shared_ptr<DeviceStager> stager;
};

// Opens the tiers that units with these (name, policy) pairs need, computing on `device`. Every
// unit that uses the disk tier must set the same dir and memory budget (ConfigError naming it).
RankTiers open_rank_tiers(const std::vector<std::pair<std::string, const OffloadPolicy*>>& units, c10::Device device);

}  // namespace fsdp::offload
