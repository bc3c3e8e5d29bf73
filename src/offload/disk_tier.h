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
// releases its disk-tier master shard once it has been read, and a checkpoint load releases
// what it touched (a save reads through the I/O threads: read_streamed). Releasing is MADV_DONTNEED on our mapping
// (dirty bits move to the page cache; no data is lost) plus POSIX_FADV_DONTNEED so that clean pages leave the page
// cache too. Files are unlinked as soon as they are open: a crashed run leaves nothing behind.
//
// Note [Disk tier I/O threads]
// The hot paths (the all-gather's read of a master shard, the optimizer's reads and writes of
// master and state chunks, a checkpoint save's reads) do not page through the mapping (MADV_RANDOM:
// each fault would read one page): they move whole ranges between the
// file and host buffers with pread/pwrite on the tier's own threads, one for reads and one for
// writes (disk_io.cpp), through a second descriptor opened with O_DIRECT where the file system
// takes it (buffered otherwise, with POSIX_FADV_DONTNEED after each transfer), so what comes from
// the disk is read from the disk and nothing lingers in the page cache. Reads are issued ahead of
// use (the next units' master shards while the current unit computes, the next chunks of the
// optimizer step while the current one is stepped); writes are queued and overlap the chunks
// after them; the step after backward leaves its last ones draining under the next forward
// (Note [The disk tier around the step after backward] in optim/optim.cpp), and whoever reads
// the files through their mappings waits for them first (flush). A read waits for the
// queued writes that overlap its range, so it never sees old bytes. Host buffers of the optimizer's
// transfers count against memory_budget_bytes (the audit adds them to the mapped pages).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include <ATen/core/Tensor.h>

#include "base/worker_queue.h"
#include "offload/tier_hooks.h"
#include "offload/tier_tensors.h"

namespace fsdp::offload {

class FileTier;

// One disk-tier file: its mapping (the tensor's storage) and descriptors. Owned by the storage's
// deleter, which waits for the file's queued transfers before unmapping.
struct Mapping {
  std::shared_ptr<FileTier> tier;  // the tier outlives its mappings
  void* base = nullptr;
  size_t bytes = 0;    // mapped bytes (the tensor's)
  int fd = -1;         // buffered descriptor
  int direct_fd = -1;  // O_DIRECT descriptor of the same file, or -1 where the file system refuses it
};
// The mapping under t's storage, or null when t is not disk-backed.
Mapping* mapping_of(const at::Tensor& t);

// The disk tier (DiskTier in tier.h). DiskTier::open creates `dir` if missing and proves it
// writable by creating, reserving and removing a probe file; it throws OffloadError naming dir and
// the system's reason otherwise.
class FileTier final : public DiskTier, public std::enable_shared_from_this<FileTier> {
 public:
  FileTier(std::string dir, int64_t budget_bytes) : dir_(std::move(dir)), budget_bytes_(budget_bytes) {}
  ~FileTier() override;

  // A zero-filled fp32 tensor of `numel` elements in a new file; `what` names it in errors.
  at::Tensor zeros(int64_t numel, const std::string& what) override;
  // Throws OffloadError when the file system has fewer than `bytes` available (statvfs), naming
  // `what` needs them. A cheap early check; the reservation itself is what guarantees the space.
  void check_free_space(int64_t bytes, const std::string& what) const override;

  const std::string& dir() const override { return dir_; }
  int64_t budget_bytes() const override { return budget_bytes_; }
  // Elements per chunk when `tensors` disk-tier tensors are streamed together: three chunks each
  // (read-ahead, current, write-behind) fit in the budget. A multiple of 1024 (one 4 KiB page of
  // floats, and of ATen's 64-element vector blocks: see Note [Bitwise-equal chunks]).
  // Throws ConfigError naming `unit` and the bytes needed when the budget is below three pages each.
  int64_t chunk_elements(int tensors, const std::string& unit = "") const override;

  int64_t file_bytes() const override;
  int64_t resident_bytes() const override;  // mincore over every live mapping
  // The test hooks (tier_hooks.h): the product's unless offload/testing.h set others.
  void set_hooks(std::shared_ptr<TierHooks> hooks) { hooks_ = std::move(hooks); }
  void audit() override { hooks_->audit(*this); }
  int64_t peak_resident_bytes() const override { return hooks_->peak_resident_bytes(); }

  // ---- the I/O threads (Note [Disk tier I/O threads], disk_io.cpp)
  // Starts reading elements [begin, end) of the disk-backed 1-D tensor `t` into a new host
  // buffer. `budgeted`: the buffer counts against the budget while it lives. `unit` names the
  // span in the trace.
  IoTicket read_async(const at::Tensor& t, int64_t begin, int64_t end, const std::string& what, bool budgeted,
                      std::vector<InPlaceRange> in_place = {}) override;
  // Starts writing the host tensor `src` (contiguous fp32) into elements [begin, begin +
  // src.numel()) of `t`. Nobody waits for it until flush() or a read of the same range.
  IoTicket write_async(const at::Tensor& t, int64_t begin, const at::Tensor& src, const std::string& what) override;
  // A host buffer of `numel` floats that counts against the budget while it lives (page-aligned,
  // pinned when a host allocator for a device is set).
  at::Tensor host_buffer(int64_t numel, bool budgeted);
  // `host` (a buffer this tier's reads returned), counted against the budget for as long as the
  // returned tensor or a view of it lives. For read buffers kept beyond their use.
  at::Tensor count_in_budget(const at::Tensor& host) override;
  // Waits for every write queued so far; throws the first failed transfer's error.
  void flush() override;
  // Waits until `bytes` more of budgeted buffers fit in `window` bytes (the budget, or a caller's
  // bound where there is none), or no write is pending.
  void wait_for_buffers(int64_t bytes, int64_t window) override;
  // Bytes of budgeted host buffers alive now.
  int64_t buffered_bytes() const override { return buffered_->load(); }
  // Held by whoever checks buffered_bytes() for room and then issues reads into it, so that two
  // threads (the optimizer's and the training thread's prefetch) do not take the same room.
  std::mutex& budget_mutex() override { return budget_mu_; }
  IoCounters io_counters() const override;
  void set_tracer(std::shared_ptr<Tracer> tracer) override;
  Tracer* tracer() const override;
  // Host buffers come from `alloc` (e.g. pinned memory for a device's copies); it must return
  // page-aligned memory for direct I/O to be used.
  void set_host_allocator(std::function<at::Tensor(int64_t numel)> alloc) override;
  // Bumped whenever a master shard may have changed (the optimizer step, a checkpoint load): a
  // read issued before it is stale.
  uint64_t generation() const override { return generation_.load(); }
  void bump_generation() override { ++generation_; }
  // Drops the page cache of every file of the tier (benchmarks: the next reads come from the disk).
  // Queued writes go on.
  void drop_page_cache();
  // Throws OffloadError when dir() is gone (removed while training), naming it.
  void check_dir() const override;

  // Internal: mappings register and unregister themselves (remove waits for their transfers).
  void add(Mapping* m);
  void remove(Mapping* m);

 private:
  IoTicket submit(std::shared_ptr<IoJob> job);
  void wait_for_transfers(Mapping* m);  // until no transfer of m's file is queued or running
  void stop_io();
  void take_io(const std::shared_ptr<IoJob>& job, int lane, std::unique_lock<std::mutex>& lock);
  void run_io(const std::shared_ptr<IoJob>& job, int lane);
  void transfer(IoJob& job);
  void read_in_place(IoJob& job);
  void wait_for_overlapping_writes(const IoJob& job, std::unique_lock<std::mutex>& lock);

  std::string dir_;
  int64_t budget_bytes_ = 0;
  std::shared_ptr<TierHooks> hooks_ = hooks_for_new_tiers();
  int64_t counter_ = 0;
  mutable std::mutex mu_;
  std::set<Mapping*> mappings_;

  // Under io_'s lock (Note [Worker queues]): the I/O bookkeeping its threads and callers share.
  std::set<IoJob*> writes_pending_;  // queued or running
  std::map<Mapping*, int> active_;   // transfers queued or running, per file
  IoCounters counters_;
  uint64_t seq_ = 0;
  std::shared_ptr<std::atomic<int64_t>> buffered_ = std::make_shared<std::atomic<int64_t>>(0);
  std::mutex budget_mu_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Tracer> tracer_;
  std::function<at::Tensor(int64_t)> host_alloc_;

  // The I/O threads, two lanes of one queue (reads, writes): started by the first transfer,
  // stopped by the destructor once what is queued has run. Its first error is the first failed
  // transfer's; later transfers still run, new ones are refused.
  static constexpr int kReadLane = 0, kWriteLane = 1;
  base::WorkerQueue<std::shared_ptr<IoJob>> io_{
      [this](std::shared_ptr<IoJob>& job, const base::Turn& turn) { run_io(job, turn.lane); }, base::AfterError::kRun,
      2,
      [this](std::shared_ptr<IoJob>& job, int lane, std::unique_lock<std::mutex>& lock) { take_io(job, lane, lock); }};
};

// The file tier that owns `t`'s mapping, or null (tier_of, for the layers above).
FileTier* file_tier_of(const at::Tensor& t);
// On the pages under elements [begin, end) of a disk-backed 1-D tensor (no-ops otherwise):
void write_behind(const at::Tensor& t, int64_t begin, int64_t end);  // start writing them back
}  // namespace fsdp::offload
