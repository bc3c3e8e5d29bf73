// OffloadPolicy and the tiers' names (fsdp/offload_policy.h; one table, base/named.h).
#include "fsdp/offload_policy.h"

#include "base/named.h"
#include "fsdp/errors.h"

namespace fsdp {

namespace {

constexpr base::Named<OffloadTier> kTiers[] = {
    {OffloadTier::kNone, "none"},
    {OffloadTier::kHost, "host"},
    {OffloadTier::kDisk, "disk"},
};

}  // namespace

const char* offload_tier_name(OffloadTier t) { return base::name_of(kTiers, t, "unknown"); }

OffloadTier parse_offload_tier(const std::string& name) {
  if (auto t = base::value_of(kTiers, name)) return *t;
  throw ConfigError("fsdp: unknown offload tier '" + name + "' (expected " + base::names_text(kTiers) + ")");
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
