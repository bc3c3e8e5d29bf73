// The disk tier's I/O threads: reads and writes of whole ranges between its files and host
// buffers, off the training thread. See Note [Disk tier I/O threads] in disk_tier.h.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "base/file_io.h"
#include "base/strings.h"
#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "offload/disk_tier.h"

namespace fsdp::offload {

struct IoJob {
  bool write = false;
  Mapping* m = nullptr;
  int64_t offset = 0;    // bytes into the file
  int64_t bytes = 0;     // bytes of the range
  at::Tensor buffer;     // host memory: a read's destination, a write's source
  int64_t capacity = 0;  // bytes usable at buffer.data_ptr() (whole pages for direct transfers)
  std::string what;
  std::vector<InPlaceRange> in_place;  // a read's ranges from other files
  uint64_t seq = 0;
  std::shared_ptr<Tracer> tracer;  // the tier's when the job was taken
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
};

namespace {

constexpr int64_t kPage = 4096;

std::string describe(int64_t bytes) { return std::to_string(bytes) + " bytes (" + base::mib(bytes, 1) + ")"; }

// pread/pwrite until `len` bytes moved; returns 0 or an errno.
int move_all(bool write, int fd, char* data, int64_t len, int64_t offset) {
  const auto bytes = static_cast<uint64_t>(len), at = static_cast<uint64_t>(offset);
  const io::Transfer t = write ? io::pwrite_full(fd, data, bytes, at) : io::pread_full(fd, data, bytes, at);
  if (t.error != 0) return t.error;
  if (t.bytes < bytes) return write ? ENOSPC : EIO;  // a short file: the reservation was lost
  return 0;
}

// The bytes a direct transfer of `job` moves, or 0 when it cannot be direct: page-aligned offset
// and memory, whole pages that stay within the file's reservation and, for a write, do not run
// into bytes of the tensor after the range.
int64_t direct_length(const IoJob& job) {
  if (job.m->direct_fd < 0) return 0;
  const auto addr = reinterpret_cast<uintptr_t>(job.buffer.data_ptr());
  const int64_t len = whole_pages(job.bytes);
  if (job.offset % kPage != 0 || addr % kPage != 0 || job.capacity < len) return 0;
  if (job.offset + len > whole_pages(static_cast<int64_t>(job.m->bytes))) return 0;
  const bool ends_on_page_or_file =
      job.bytes % kPage == 0 || job.offset + job.bytes == static_cast<int64_t>(job.m->bytes);
  if (job.write && !ends_on_page_or_file) return 0;
  return len;
}

}  // namespace

// ---- tickets

void IoTicket::wait() {
  if (!job_) return;
  std::unique_lock<std::mutex> lock(job_->mu);
  job_->cv.wait(lock, [&] { return job_->done; });
  if (!job_->error.empty()) throw OffloadError(job_->error);
}

const at::Tensor& IoTicket::buffer() const { return job_->buffer; }

// ---- buffers

at::Tensor FileTier::host_buffer(int64_t numel, bool budgeted) {
  const int64_t bytes = whole_pages(std::max<int64_t>(numel, 1) * static_cast<int64_t>(sizeof(float)));
  const int64_t elems = bytes / static_cast<int64_t>(sizeof(float));
  std::shared_ptr<std::atomic<int64_t>> counter;
  if (budgeted) {
    counter = buffered_;
    *counter += bytes;
  }
  at::Tensor base;
  if (host_alloc_) base = host_alloc_(elems);
  void* data = base.defined() ? base.data_ptr() : nullptr;
  if (data == nullptr) {
    if (::posix_memalign(&data, kPage, static_cast<size_t>(bytes)) != 0) {
      if (counter) *counter -= bytes;
      throw OffloadError("fsdp: disk tier: cannot allocate a host buffer of " + describe(bytes));
    }
  }
  const bool owned = !base.defined();
  at::Tensor out = at::from_blob(
      data, {elems},
      [base, counter, bytes, owned](void* p) {
        if (owned) std::free(p);
        if (counter) *counter -= bytes;
      },
      at::TensorOptions().dtype(at::kFloat).pinned_memory(base.defined() && base.is_pinned()));
  return out.narrow(0, 0, numel);
}

at::Tensor FileTier::count_in_budget(const at::Tensor& host) {
  // A tensor over the same whole pages (so direct transfers from it stay direct) whose deleter
  // gives the bytes back and keeps `host` alive until then.
  const int64_t bytes = static_cast<int64_t>(host.storage().nbytes());
  const int64_t offset = host.storage_offset();
  std::shared_ptr<std::atomic<int64_t>> counter = buffered_;
  *counter += bytes;
  at::Tensor base = at::from_blob(
      host.storage().mutable_data(), {bytes / static_cast<int64_t>(sizeof(float))},
      [keep = host, counter, bytes](void*) { *counter -= bytes; }, host.options());
  return base.narrow(0, offset, host.numel());
}

void FileTier::set_host_allocator(std::function<at::Tensor(int64_t numel)> alloc) { host_alloc_ = std::move(alloc); }

// ---- submitting

IoTicket FileTier::read_async(const at::Tensor& t, int64_t begin, int64_t end, const std::string& what, bool budgeted,
                              std::vector<InPlaceRange> in_place) {
  Mapping* m = mapping_of(t);
  if (m == nullptr) throw ConfigError("fsdp: disk tier: read of a tensor that is not disk-backed (" + what + ")");
  auto job = std::make_shared<IoJob>();
  job->m = m;
  job->offset = (static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(m->base)) +
                begin * static_cast<int64_t>(sizeof(float));
  job->bytes = (end - begin) * static_cast<int64_t>(sizeof(float));
  job->buffer = host_buffer(end - begin, budgeted);
  job->capacity = whole_pages(job->bytes);
  job->what = what;
  job->in_place = std::move(in_place);
  return submit(std::move(job));
}

IoTicket FileTier::write_async(const at::Tensor& t, int64_t begin, const at::Tensor& src, const std::string& what) {
  Mapping* m = mapping_of(t);
  if (m == nullptr) throw ConfigError("fsdp: disk tier: write to a tensor that is not disk-backed (" + what + ")");
  auto job = std::make_shared<IoJob>();
  job->write = true;
  job->m = m;
  job->offset = (static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(m->base)) +
                begin * static_cast<int64_t>(sizeof(float));
  job->bytes = src.numel() * static_cast<int64_t>(sizeof(float));
  job->buffer = src.is_contiguous() ? src : src.contiguous();
  job->capacity =
      static_cast<int64_t>(job->buffer.storage().nbytes()) -
      (static_cast<const char*>(job->buffer.data_ptr()) - static_cast<const char*>(job->buffer.storage().data()));
  job->what = what;
  return submit(std::move(job));
}

IoTicket FileTier::submit(std::shared_ptr<IoJob> job) {
  auto lock = io_.lock();
  if (std::exception_ptr e = io_.error_locked()) std::rethrow_exception(e);
  job->seq = ++seq_;
  ++active_[job->m];
  if (job->write) {
    writes_pending_.insert(job.get());
    // Counted when queued: a write may drain after the step that queued it (a failed one is
    // reported by the next flush or overlapping read).
    counters_.bytes_written += direct_length(*job) > 0 ? whole_pages(job->bytes) : job->bytes;
    ++counters_.writes;
  }
  io_.submit_locked(job, job->write ? kWriteLane : kReadLane);
  io_.notify();
  return IoTicket(std::move(job));
}

// ---- the threads

void FileTier::wait_for_overlapping_writes(const IoJob& job, std::unique_lock<std::mutex>& lock) {
  io_.wait(lock, [&] {
    for (const IoJob* w : writes_pending_) {
      if (w->m == job.m && w->seq < job.seq && w->offset < job.offset + job.bytes &&
          job.offset < w->offset + w->bytes) {
        return false;
      }
    }
    return true;
  });
}

// Under the lock, as a job is taken: a read first waits for the queued writes it overlaps.
void FileTier::take_io(const std::shared_ptr<IoJob>& job, int lane, std::unique_lock<std::mutex>& lock) {
  job->tracer = tracer_;
  if (lane == kReadLane) wait_for_overlapping_writes(*job, lock);
}

void FileTier::run_io(const std::shared_ptr<IoJob>& job, int lane) {
  const bool writes = lane == kWriteLane;
  const auto begin = std::chrono::steady_clock::now();
  transfer(*job);
  if (job->tracer) {
    job->tracer->span(writes ? "fsdp::disk_write" : "fsdp::disk_read", writes ? "disk write" : "disk read", begin,
                      std::chrono::steady_clock::now(), job->what);
  }
  const int64_t moved = direct_length(*job) > 0 ? whole_pages(job->bytes) : job->bytes;
  if (writes) job->buffer = at::Tensor();  // the budget gets the bytes back now
  {
    auto lock = io_.lock();
    if (writes) writes_pending_.erase(job.get());
    if (--active_[job->m] == 0) active_.erase(job->m);
    if (!job->error.empty() && !io_.error_locked())
      io_.keep_error_locked(std::make_exception_ptr(OffloadError(job->error)));
    if (job->error.empty() && !writes) {
      counters_.bytes_read += moved;
      ++counters_.reads;
    }
  }
  {
    std::lock_guard<std::mutex> lock(job->mu);
    job->done = true;
  }
  job->cv.notify_all();
  // The queue notifies its waiters (flush, wait_for_buffers, wait_for_transfers) after the job.
}

void FileTier::transfer(IoJob& job) {
  if (!job.in_place.empty()) return read_in_place(job);
  char* data = static_cast<char*>(job.buffer.data_ptr());
  const int64_t direct = direct_length(job);
  int err = direct > 0 ? move_all(job.write, job.m->direct_fd, data, direct, job.offset) : EINVAL;
  // EINVAL: not direct, or the file system refused direct I/O after all: the buffered descriptor.
  if (err == EINVAL) err = move_all(job.write, job.m->fd, data, job.bytes, job.offset);
  if (err == 0) {
    // Written back and out of the page cache (a direct transfer can leave pages there too, e.g.
    // ext4 completing a write to reserved blocks), so the tier's pages stay within the budget.
    const int64_t len = direct > 0 ? direct : whole_pages(job.bytes);
    if (job.write) {
      ::sync_file_range(job.m->fd, job.offset, len,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    }
    ::posix_fadvise(job.m->fd, job.offset, len, POSIX_FADV_DONTNEED);
    return;
  }
  job.error = "fsdp: offload.dir " + dir_ + ": " + (job.write ? "writing " : "reading ") + describe(job.bytes) +
              " of " + job.what + (job.write ? " to " : " from ") + "its disk-tier file failed: " + std::strerror(err) +
              (job.write ? "; free space (or lift the file-size limit) under offload.dir, then resume from the last "
                           "checkpoint"
                         : "; check the disk under offload.dir, then resume from the last checkpoint");
}

// A read whose ranges in `in_place` come from their files: the tier's file is read between them
// (buffered: the gaps need not start on pages), each file's range after it; nothing stays cached.
void FileTier::read_in_place(IoJob& job) {
  char* data = static_cast<char*>(job.buffer.data_ptr());
  int64_t pos = 0;
  auto gap = [&](int64_t to) {
    const int err = to > pos ? move_all(false, job.m->fd, data + pos, to - pos, job.offset + pos) : 0;
    if (err != 0 && job.error.empty()) {
      job.error = "fsdp: offload.dir " + dir_ + ": reading " + describe(to - pos) + " of " + job.what +
                  " from its disk-tier file failed: " + std::strerror(err) +
                  "; check the disk under offload.dir, then resume from the last checkpoint";
    }
    pos = to;
  };
  for (const InPlaceRange& r : job.in_place) {
    gap(r.at);
    try {
      r.file->pread_all(data + r.at, static_cast<uint64_t>(r.bytes), static_cast<uint64_t>(r.offset));
    } catch (const std::exception& e) {
      if (job.error.empty()) {
        job.error = "fsdp: reading " + describe(r.bytes) + " of " + job.what + " in place from " + r.file->path() +
                    " failed (" + e.what() + "); the imported files are read at every gather: keep them in place " +
                    "and unchanged while training, then resume from the last checkpoint";
      }
    }
    ::posix_fadvise(r.file->fd(), r.offset, r.bytes, POSIX_FADV_DONTNEED);
    pos = r.at + r.bytes;
  }
  gap(job.bytes);
  ::posix_fadvise(job.m->fd, job.offset, whole_pages(job.bytes), POSIX_FADV_DONTNEED);
}

void FileTier::flush() {
  auto lock = io_.lock();
  io_.wait(lock, [&] { return writes_pending_.empty(); });
  if (std::exception_ptr e = io_.error_locked()) std::rethrow_exception(e);
}

void FileTier::wait_for_buffers(int64_t bytes, int64_t window) {
  if (window <= 0) return;
  auto lock = io_.lock();
  io_.wait(lock, [&] { return buffered_->load() + bytes <= window || writes_pending_.empty(); });
}

void FileTier::wait_for_transfers(Mapping* m) {
  auto lock = io_.lock();
  io_.wait(lock, [&] { return active_.count(m) == 0; });
}

void FileTier::stop_io() { io_.stop(base::OnStop::kDrain); }

IoCounters FileTier::io_counters() const {
  auto lock = io_.lock();
  return counters_;
}

void FileTier::set_tracer(std::shared_ptr<Tracer> tracer) {
  auto lock = io_.lock();
  tracer_ = std::move(tracer);
}

Tracer* FileTier::tracer() const {
  auto lock = io_.lock();
  return tracer_.get();
}

void FileTier::drop_page_cache() {
  // Queued writes may go on (they go straight to the disk, or leave the cache after themselves).
  std::lock_guard<std::mutex> lock(mu_);
  for (Mapping* m : mappings_) {
    ::madvise(m->base, m->bytes, MADV_DONTNEED);
    ::sync_file_range(m->fd, 0, 0, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    ::posix_fadvise(m->fd, 0, 0, POSIX_FADV_DONTNEED);
  }
}

void FileTier::check_dir() const {
  struct stat st {};
  if (::stat(dir_.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return;
  const int err = errno;
  throw OffloadError("fsdp: offload.dir " + dir_ + " is gone (" + (err != 0 ? std::strerror(err) : "not a directory") +
                     "): was it removed while training? The disk tier needs it for new files (optimizer state, "
                     "checkpoint snapshots and loads); recreate it and resume from the last checkpoint");
}

void read_streamed(const at::Tensor& t, int64_t begin, int64_t end, const std::string& what,
                   const std::function<void(const float* data, int64_t at, int64_t count)>& fn) {
  if (end <= begin) return;
  Mapping* m = mapping_of(t);
  if (m == nullptr) {
    fn(t.data_ptr<float>() + begin, begin, end - begin);
    return;
  }
  // Chunks start on the file's pages, so each moves directly (Note [Disk tier I/O threads]);
  // two are in flight, sized as the budget allows for a copy (chunk_elements(2)).
  const at::Tensor flat = t.view({-1});
  const int64_t first = (static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(m->base)) / 4;
  const int64_t page = kPage / 4;
  int64_t chunk = page;  // a budget too small for two tensors' chunks still reads a page at a time
  try {
    chunk = m->tier->chunk_elements(2);
  } catch (const ConfigError&) {
  }
  int64_t next = std::max<int64_t>(0, (first + begin) / page * page - first);
  std::deque<std::pair<int64_t, IoTicket>> ahead;  // (first element, its read)
  auto issue = [&] {
    const int64_t b = std::min(end, next + chunk);
    ahead.emplace_back(next, m->tier->read_async(flat, next, b, what, /*budgeted=*/false));
    next = b;
  };
  while (ahead.size() < 2 && next < end) issue();
  while (!ahead.empty()) {
    auto [a, ticket] = std::move(ahead.front());
    ahead.pop_front();
    ticket.wait();
    if (next < end) issue();  // the read thread goes on while fn uses this chunk
    const int64_t from = std::max(a, begin), to = std::min(end, a + ticket.buffer().numel());
    fn(ticket.buffer().data_ptr<float>() + (from - a), from, to - from);
  }
}

RangeWriter::RangeWriter(at::Tensor t, std::string what) : t_(t.view({-1})), what_(std::move(what)) {}

RangeWriter::~RangeWriter() {
  try {
    finish();
  } catch (const std::exception&) {
  }
}

void RangeWriter::put(int64_t begin, const at::Tensor& src) {
  Mapping* m = mapping_of(t_);
  if (m == nullptr) {
    t_.narrow(0, begin, src.numel()).copy_(src.view({-1}));
    return;
  }
  IoTicket& slot = inflight_[next_];
  next_ = 1 - next_;
  slot.wait();  // the write two back: at most two buffers in flight
  slot = m->tier->write_async(t_, begin, src.view({-1}), what_);
}

void RangeWriter::make_room() {
  IoTicket done = std::move(inflight_[next_]);
  inflight_[next_] = IoTicket();
  done.wait();
}

void RangeWriter::finish() {
  for (IoTicket& t : inflight_) {
    IoTicket done = std::move(t);
    t = IoTicket();
    done.wait();
  }
}

}  // namespace fsdp::offload
