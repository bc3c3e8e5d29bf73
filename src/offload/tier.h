// The tier interface: the disk tier as the layers above see it (its mechanism: disk_tier.h); a
// tensor's operations in its tier are in tier_tensors.h.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>
#include <ATen/core/Tensor.h>
#include "base/file_io.h"
#include "fsdp/trace.h"
#include "offload/placement.h"  // whole_pages
namespace fsdp::offload {
struct IoJob;
class IoTicket {  // a transfer on the disk tier's I/O threads; wait() throws its OffloadError
 public:
  IoTicket() = default;
  explicit IoTicket(std::shared_ptr<IoJob> job) : job_(std::move(job)) {}
  void wait();  // a second wait is a no-op
  bool valid() const { return job_ != nullptr; }
  const at::Tensor& buffer() const;  // a read's host buffer, once waited for
 private:
  std::shared_ptr<IoJob> job_;
};
struct IoCounters {  // bytes moved by the I/O threads (whole pages; writes once queued), and transfers
  int64_t bytes_read = 0, bytes_written = 0, reads = 0, writes = 0;
};
using InPlaceRange = io::FileRange;  // a read's bytes from another file (Note [NF4 codes read in place])
class DiskTier {                     // fp32 tensors in files under dir(), at most budget_bytes() of them in memory
 public:
  static std::shared_ptr<DiskTier> open(const std::string& dir, int64_t budget_bytes);  // probes dir
  virtual ~DiskTier() = default;
  virtual at::Tensor zeros(int64_t numel, const std::string& what) = 0;  // a new, reserved file
  virtual void check_free_space(int64_t bytes, const std::string& what) const = 0;
  virtual void check_dir() const = 0;  // OffloadError when dir() was removed
  virtual const std::string& dir() const = 0;
  virtual int64_t budget_bytes() const = 0;
  virtual int64_t chunk_elements(int tensors, const std::string& unit = "") const = 0;
  virtual IoTicket read_async(const at::Tensor& t, int64_t a, int64_t b, const std::string& what, bool budgeted,
                              std::vector<InPlaceRange> in_place = {}) = 0;  // sorted, disjoint, within [a, b)
  virtual IoTicket write_async(const at::Tensor& t, int64_t begin, const at::Tensor& src, const std::string& what) = 0;
  virtual at::Tensor count_in_budget(const at::Tensor& host) = 0;  // a kept read buffer
  virtual void flush() = 0;                                        // waits for the queued writes
  virtual void wait_for_buffers(int64_t bytes, int64_t window) = 0;
  virtual int64_t buffered_bytes() const = 0;
  virtual std::mutex& budget_mutex() = 0;   // held while taking room in the budget
  virtual uint64_t generation() const = 0;  // bumped when a master may have changed
  virtual void bump_generation() = 0;
  virtual int64_t file_bytes() const = 0;
  virtual int64_t resident_bytes() const = 0;
  virtual void audit() = 0;  // the test hooks' audit point (offload/tier_hooks.h); a product run's does nothing
  virtual int64_t peak_resident_bytes() const = 0;
  virtual IoCounters io_counters() const = 0;
  virtual void set_tracer(std::shared_ptr<Tracer> tracer) = 0;
  virtual Tracer* tracer() const = 0;
  virtual void set_host_allocator(std::function<at::Tensor(int64_t numel)> alloc) = 0;
};
}  // namespace fsdp::offload
