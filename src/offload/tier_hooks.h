// The disk tier's test hooks: where a test steers or watches a tier (offload/testing.h installs
// its own, src/offload/testing.cpp). A product run's hooks do what the tier alone would: they map
// its files and audit nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace fsdp::offload {

class FileTier;

struct TierHooks {
  virtual ~TierHooks() = default;
  // mmap(MAP_SHARED) of `bytes` of `fd`, or MAP_FAILED with errno set.
  virtual void* map_shared(int fd, size_t bytes) const;
  // At each audit point (DiskTier::audit: after each chunk of the streamed step, after each
  // gather's read of a disk-tier master), and the most it saw (DiskTierStats::peak_resident_bytes).
  virtual void audit(const FileTier& /*tier*/) {}
  virtual int64_t peak_resident_bytes() const { return 0; }
};

// The hooks of a tier opened now: the product's, unless a test installed others (offload/testing.h).
std::shared_ptr<TierHooks> hooks_for_new_tiers();

}  // namespace fsdp::offload
