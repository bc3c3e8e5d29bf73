// The tier interface: all the layers above see of the disk tier (its mechanism: disk_tier.h).
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <ATen/core/Tensor.h>
#include "fsdp/trace.h"
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
class DiskTier {  // fp32 tensors in files under dir(), at most budget_bytes() of them in memory
 public:
  static std::shared_ptr<DiskTier> open(const std::string& dir, int64_t budget_bytes);  // probes dir
  virtual ~DiskTier() = default;
  virtual at::Tensor zeros(int64_t numel, const std::string& what) = 0;  // a new, reserved file
  virtual void check_free_space(int64_t bytes, const std::string& what) const = 0;
  virtual void check_dir() const = 0;  // OffloadError when dir() was removed
  virtual const std::string& dir() const = 0;
  virtual int64_t budget_bytes() const = 0;
  virtual int64_t chunk_elements(int tensors, const std::string& unit = "") const = 0;
  virtual IoTicket read_async(const at::Tensor& t, int64_t a, int64_t b, const std::string& what, bool budgeted) = 0;
  virtual IoTicket write_async(const at::Tensor& t, int64_t begin, const at::Tensor& src, const std::string& what) = 0;
  virtual at::Tensor count_in_budget(const at::Tensor& host) = 0;  // a kept read buffer
  virtual void flush() = 0;                                        // waits for the queued writes
  virtual void wait_for_buffers(int64_t bytes) = 0;
  virtual int64_t buffered_bytes() const = 0;
  virtual std::mutex& budget_mutex() = 0;   // held while taking room in the budget
  virtual uint64_t generation() const = 0;  // bumped when a master may have changed
  virtual void bump_generation() = 0;
  virtual int64_t file_bytes() const = 0;
  virtual int64_t resident_bytes() const = 0;
  virtual void audit() = 0;  // records resident_bytes() in the peak while auditing (offload/testing.h)
  virtual int64_t peak_resident_bytes() const = 0;
  virtual IoCounters io_counters() const = 0;
  virtual void set_tracer(std::shared_ptr<Tracer> tracer) = 0;
  virtual Tracer* tracer() const = 0;
  virtual void set_host_allocator(std::function<at::Tensor(int64_t numel)> alloc) = 0;
};
bool is_disk_backed(const at::Tensor& t);  // views included
DiskTier* tier_of(const at::Tensor& t);    // null unless disk-backed
inline int64_t whole_pages(int64_t bytes) { return (bytes + 4095) / 4096 * 4096; }
void release(const at::Tensor& t, int64_t begin = 0, int64_t end = -1);  // pages leave memory; -1: the end
at::Tensor read_whole(const at::Tensor& t, const std::string& what);     // host values (I/O threads)
at::Tensor clone_in_tier(const at::Tensor& t);                           // a device tensor's clone is a host copy
void copy_streamed(const at::Tensor& dst, const at::Tensor& src);
// fn(data, at, count) over elements [begin, end) of a contiguous fp32 host tensor, in order: one
// call on its own memory, or for a disk-backed one host chunks the tier's read thread reads ahead
// (direct, whole pages; never through the mapping, whose faults read a page at a time).
void read_streamed(const at::Tensor& t, int64_t begin, int64_t end, const std::string& what,
                   const std::function<void(const float* data, int64_t at, int64_t count)>& fn);
at::Tensor zeros_in_tier(const at::Tensor& t, const std::string& what);
// Host fp32 buffers written into ranges of t's elements: copied for a tensor in memory; for a
// disk-backed one, written by the tier's write thread with at most two in flight (never through
// the mapping, whose write faults read each page in first). finish() waits (throws an I/O error).
class RangeWriter {
 public:
  RangeWriter(at::Tensor t, std::string what);
  ~RangeWriter();  // waits, swallowing an error (finish() reports it)
  RangeWriter(const RangeWriter&) = delete;
  RangeWriter& operator=(const RangeWriter&) = delete;
  void put(int64_t begin, const at::Tensor& src);  // src: contiguous fp32 on the host, not reused after
  void finish();

 private:
  at::Tensor t_;
  std::string what_;
  IoTicket inflight_[2];
  int next_ = 0;
};
}  // namespace fsdp::offload
