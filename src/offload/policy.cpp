// OffloadPolicy and the tiers' names (fsdp/offload_policy.h).
#include "fsdp/offload_policy.h"

#include "fsdp/errors.h"

namespace fsdp {

const char* offload_tier_name(OffloadTier t) {
  switch (t) {
    case OffloadTier::kNone: return "none";
    case OffloadTier::kHost: return "host";
    case OffloadTier::kDisk: return "disk";
  }
  return "unknown";
}

OffloadTier parse_offload_tier(const std::string& name) {
  for (auto t : {OffloadTier::kNone, OffloadTier::kHost, OffloadTier::kDisk}) {
    if (name == offload_tier_name(t)) return t;
  }
  throw ConfigError("fsdp: unknown offload tier '" + name + "' (expected none, host or disk)");
}

void OffloadPolicy::validate() const {
  if (uses(OffloadTier::kDisk) && dir_.empty()) {
    throw ConfigError("fsdp: offload.dir is empty but a state is offloaded to \"disk\" (params=" +
                      std::string(offload_tier_name(params_)) + ", grads=" + offload_tier_name(grads_) +
                      ", optimizer_state=" + offload_tier_name(optimizer_state_) + "); name a directory");
  }
  if (memory_budget_bytes_ < 0) {
    throw ConfigError("fsdp: offload.memory_budget_bytes=" + std::to_string(memory_budget_bytes_) + " must be >= 0");
  }
}

}  // namespace fsdp
