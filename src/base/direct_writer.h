// Writes byte spans into an existing file at the disk's speed: the whole pages of each run of
// contiguous spans go straight to the disk (O_DIRECT, from a page-aligned staging buffer), and
// only the partial pages at a run's ends go through the page cache. Several writers (the ranks of
// a checkpoint save) may write disjoint spans of one file at once.
//
// Note [Direct writes of a checkpoint]
// A buffered write copies into the page cache and leaves the disk to the kernel's writeback,
// which here moves well under the disk's bandwidth (dd: 0.45-0.75 GB/s buffered with fsync,
// 1.2-2.0 GB/s with O_DIRECT), and the final fsync waits for all of it. Direct writes need the
// file offset, the length and the memory page-aligned, which a shard's bytes in a safetensors
// file are not; so the writer stages each run in a buffer whose offsets follow the file's pages.
// A page written directly lies wholly inside one writer's run, so no other writer touches it; a
// page shared with a neighbour's bytes (another rank's shard, the header) is written through the
// page cache by each of them, where the kernel merges the parts. A file system that refuses
// O_DIRECT (tmpfs) gets buffered writes throughout.
//
// The writes go out on a thread of the writer's own, from two staging buffers: the caller fills
// one while the other is written, so the caller's work (copying, or waiting for the disk tier's
// reads of what it saves) overlaps the disk's writes. A write that fails is reported by the next
// write() or by finish().
#pragma once

#include <cstdint>
#include <string>

#include "base/worker_queue.h"

namespace fsdp::io {

struct DirectWriteCounters {
  int64_t direct_bytes = 0, direct_writes = 0;      // whole pages through O_DIRECT
  int64_t buffered_bytes = 0, buffered_writes = 0;  // partial pages (or everything where refused)
};

class DirectWriter {
 public:
  // Opens `path` (which must exist: a prepared file) for writing. `buffer_bytes` is rounded up to
  // whole pages.
  explicit DirectWriter(const std::string& path, int64_t buffer_bytes = kDefaultBufferBytes);
  DirectWriter(const DirectWriter&) = delete;
  DirectWriter& operator=(const DirectWriter&) = delete;
  ~DirectWriter();

  // `bytes` of `data` at byte `offset`: continues the current run when it starts where the run
  // ends, else sends the run out and starts a new one. Returns once `data` is copied.
  void write(const void* data, int64_t bytes, int64_t offset);
  // Writes what is staged, waits for every write, fsyncs and closes; throws CheckpointError naming
  // the file on failure.
  void finish();
  // Complete after finish().
  const DirectWriteCounters& counters() const { return counters_; }

  static constexpr int64_t kDefaultBufferBytes = 16 << 20;
  // The buffers of a writer open during an optimizer step (checkpoint::SaveInStep: one per file,
  // beside the step's own window of disk-tier chunks).
  static constexpr int64_t kInStepBufferBytes = 4 << 20;
  // The host memory a writer holds: its two staging buffers.
  static int64_t memory_bytes(int64_t buffer_bytes = kDefaultBufferBytes);

 private:
  // A staged stretch of one buffer for the writer thread: bytes [begin, end) of buffer `slot`,
  // whose byte 0 is at file offset `base`.
  struct Out {
    int slot = 0;
    int64_t base = 0, begin = 0, end = 0;
  };
  void send(int64_t begin, int64_t end);  // the current buffer's [begin, end) to the thread
  void take_buffer();                     // waits until the current buffer is written out
  void rethrow_error();
  void write_out(const Out& o);  // on the thread
  void pwrite_all(int fd, const char* data, int64_t bytes, int64_t offset);

  std::string path_;
  int fd_ = -1;         // buffered
  int direct_fd_ = -1;  // O_DIRECT, or -1 where refused (the thread's from the first write)
  char* buffers_[2] = {nullptr, nullptr};
  bool busy_[2] = {false, false};  // under queue_'s lock: sent and not yet written
  int slot_ = 0;                   // the buffer being filled
  int64_t capacity_ = 0;
  int64_t base_ = 0;  // file offset of the current buffer's byte 0, page-aligned
  int64_t head_ = 0;  // staged bytes are [head_, fill_) of the current buffer
  int64_t fill_ = 0;
  DirectWriteCounters counters_;  // the thread's
  base::WorkerQueue<Out> queue_;  // last: stopped before the buffers go
};

}  // namespace fsdp::io
