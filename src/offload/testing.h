// Test switches of the offload layer, for tests and benchmarks only (the installed package does
// not ship this header).
#pragma once

#include "offload/tier_tensors.h"

namespace fsdp::offload::testing {

// Makes the disk tier's mmap calls fail with ENODEV, as on a file system without mmap support.
void fail_mmap(bool on);
// Records the tier's resident pages at each audit point (peak_resident_bytes).
void set_audit(DiskTier& tier, bool on);
// Drops the page cache of every file of the tier: the next reads come from the disk.
void drop_page_cache(DiskTier& tier);

}  // namespace fsdp::offload::testing
