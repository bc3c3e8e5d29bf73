// A tensor's operations in its tier (memory or the disk tier), for the layers above: what they
// use of the tier besides the DiskTier object (tier.h).
#pragma once

#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

#include "offload/tier.h"

namespace fsdp::offload {

bool is_disk_backed(const at::Tensor& t);                                // views included
DiskTier* tier_of(const at::Tensor& t);                                  // null unless disk-backed
void release(const at::Tensor& t, int64_t begin = 0, int64_t end = -1);  // pages leave memory; -1: the end
at::Tensor clone_in_tier(const at::Tensor& t);                           // a device tensor's clone is a host copy
void copy_streamed(const at::Tensor& dst, const at::Tensor& src);
// fn(data, at, count) over elements [begin, end) of a contiguous fp32 host tensor, in order: one
// call on its own memory, or for a disk-backed one host chunks the tier's read thread reads ahead
// (direct, whole pages; never through the mapping, whose faults read a page at a time).
void read_streamed(const at::Tensor& t, int64_t begin, int64_t end, const std::string& what,
                   const std::function<void(const float* data, int64_t at, int64_t count)>& fn);
at::Tensor zeros_in_tier(const at::Tensor& t, const std::string& what);
// On the file under a disk-backed tensor (no-ops otherwise), bytes counted from t's first one:
// the whole pages of [begin, end) give their blocks back (read as zeros until written again),
void punch_hole(const at::Tensor& t, int64_t begin, int64_t end);
// and every block is reserved again, before writes into holes (OffloadError naming the bytes on a full disk).
void reserve_blocks(const at::Tensor& t, const std::string& what);

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
  // Waits for the write put() would wait for next and lets its buffer go: called before making
  // the next buffer, two exist at a time instead of three.
  void make_room();
  void finish();

 private:
  at::Tensor t_;
  std::string what_;
  IoTicket inflight_[2];
  int next_ = 0;
};
}  // namespace fsdp::offload
