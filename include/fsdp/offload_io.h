// Bytes offload moves, per rank (the offload layer's figure, plain data): what offload_io
// (fsdp/offload.h) measures and what offload_plan and fsdp::plan (fsdp/plan.h) predict.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace fsdp {

// Bytes offload moves, per rank: through the disk tier's I/O threads (reads and writes of its
// files) and through the stager (copies between host and device memory; clones on CPU runs).
struct OffloadIo {
  int64_t disk_read = 0, disk_write = 0;
  int64_t to_device = 0, to_host = 0;
  OffloadIo operator-(const OffloadIo& e) const {
    return {disk_read - e.disk_read, disk_write - e.disk_write, to_device - e.to_device, to_host - e.to_host};
  }
  OffloadIo per_step(int64_t steps) const {  // this / steps
    if (steps <= 0) return *this;
    return {disk_read / steps, disk_write / steps, to_device / steps, to_host / steps};
  }
  std::string to_string() const {
    auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
    char s[192];
    std::snprintf(s, sizeof s, "disk read %.1f MiB, disk write %.1f MiB, to device %.1f MiB, to host %.1f MiB",
                  mib(disk_read), mib(disk_write), mib(to_device), mib(to_host));
    return s;
  }
};

}  // namespace fsdp
