// The disk tier: fp32 tensors whose storage is a MAP_SHARED mapping of a file under
// OffloadPolicy::dir, so every ATen op, the all-gather's copy-in and checkpoint save/load use them
// unchanged, while the kernel pages them in and out. Blocks are reserved with posix_fallocate
// when a file is created, so a full disk fails then, with an OffloadError naming the directory
// and the bytes, and never as a SIGBUS on a later write.
//
// Note [Disk tier residency]
// Pages of a mapping that were touched stay mapped (and count in the process's RSS as file pages)
// until released. The tier releases them explicitly: the streamed optimizer step (streamed_step.h)
// keeps at most three chunks per tensor mapped (read-ahead, current, write-behind), an all-gather
// releases its disk-tier master shard once it has been read, and checkpoint save/load release
// what they touched. Releasing is MADV_DONTNEED on our mapping (dirty bits move to the page
// cache; no data is lost) plus POSIX_FADV_DONTNEED so that clean pages leave the page cache too.
// Files are unlinked as soon as they are open: a crashed run leaves nothing behind.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include <ATen/core/Tensor.h>

namespace fsdp::offload {

struct Mapping;

class DiskTier : public std::enable_shared_from_this<DiskTier> {
 public:
  // Creates `dir` if missing and proves it writable by creating, reserving and removing a probe
  // file; throws OffloadError naming dir and the system's reason otherwise.
  static std::shared_ptr<DiskTier> open(const std::string& dir, int64_t budget_bytes);
  ~DiskTier();

  // A zero-filled fp32 tensor of `numel` elements in a new file; `what` names it in errors.
  at::Tensor zeros(int64_t numel, const std::string& what);
  // Throws OffloadError when the file system has fewer than `bytes` available (statvfs), naming
  // `what` needs them. A cheap early check; the reservation itself is what guarantees the space.
  void check_free_space(int64_t bytes, const std::string& what) const;

  const std::string& dir() const { return dir_; }
  int64_t budget_bytes() const { return budget_bytes_; }
  // Elements per chunk when `tensors` disk-tier tensors are streamed together: three chunks each
  // (read-ahead, current, write-behind) fit in the budget. A multiple of 1024 (one 4 KiB page of
  // floats, and of ATen's 64-element vector blocks: see Note [Bitwise-equal chunks]).
  int64_t chunk_elements(int tensors) const;

  int64_t file_bytes() const;
  int64_t resident_bytes() const;  // mincore over every live mapping
  void set_audit(bool on) { audit_ = on; }
  bool audit_on() const { return audit_; }
  void audit();  // records resident_bytes() into the peak when auditing
  int64_t peak_resident_bytes() const { return peak_resident_; }

  // Internal: mappings register and unregister themselves.
  void add(Mapping* m);
  void remove(Mapping* m);

 private:
  DiskTier(std::string dir, int64_t budget_bytes) : dir_(std::move(dir)), budget_bytes_(budget_bytes) {}

  std::string dir_;
  int64_t budget_bytes_ = 0;
  bool audit_ = false;
  int64_t peak_resident_ = 0;
  int64_t counter_ = 0;
  mutable std::mutex mu_;
  std::set<Mapping*> mappings_;
};

// Whether `t`'s storage is a disk-tier mapping (views included).
bool is_disk_backed(const at::Tensor& t);
// The tier that owns `t`'s mapping, or null.
DiskTier* tier_of(const at::Tensor& t);
// On the pages under elements [begin, end) of a disk-backed 1-D tensor (no-ops otherwise):
void will_need(const at::Tensor& t, int64_t begin, int64_t end);     // start reading them in
void write_behind(const at::Tensor& t, int64_t begin, int64_t end);  // start writing them back
void release(const at::Tensor& t, int64_t begin, int64_t end);       // unmap them (data kept)
inline void release(const at::Tensor& t) { release(t, 0, t.defined() ? t.numel() : 0); }
// A tensor of t's shape with t's values, in t's tier: a new disk-tier file when t is disk-backed,
// a RAM clone otherwise, a host copy of a device tensor (checkpoint snapshots; no RAM copy of
// disk-tier state, no second copy in device memory).
at::Tensor clone_in_tier(const at::Tensor& t);
// dst.copy_(src) in chunks, releasing disk-tier pages as it goes (either may be disk-backed).
void copy_streamed(const at::Tensor& dst, const at::Tensor& src);
// Zeros shaped like `t` in t's tier.
at::Tensor zeros_in_tier(const at::Tensor& t, const std::string& what);

}  // namespace fsdp::offload
