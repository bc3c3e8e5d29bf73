// See direct_writer.h and Note [Direct writes of a checkpoint] there.
#include "base/direct_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/file_io.h"
#include "fsdp/errors.h"

namespace fsdp::io {
namespace {

constexpr int64_t kPage = 4096;

int64_t round_up(int64_t n) { return (n + kPage - 1) / kPage * kPage; }
int64_t round_down(int64_t n) { return n / kPage * kPage; }

}  // namespace

DirectWriter::DirectWriter(const std::string& path, int64_t buffer_bytes)
    : path_(path), capacity_(std::max(round_up(buffer_bytes), kPage)), queue_([this](Out& o, const base::Turn& turn) {
        if (!turn.first_error) write_out(o);  // after a failure the file is abandoned
        auto lock = queue_.lock();
        busy_[o.slot] = false;  // the queue notifies after every job
      }) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) throw CheckpointError("fsdp: cannot open for writing " + path + ": " + std::strerror(errno));
  direct_fd_ = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);  // -1 where refused: buffered
}

DirectWriter::~DirectWriter() {
  queue_.stop(base::OnStop::kDrop);  // a write in progress ends first; none is left to touch the buffers
  for (char* b : buffers_) std::free(b);
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

int64_t DirectWriter::memory_bytes(int64_t buffer_bytes) { return 2 * std::max(round_up(buffer_bytes), kPage); }

void DirectWriter::rethrow_error() {
  if (auto e = queue_.error()) std::rethrow_exception(e);
}

void DirectWriter::send(int64_t begin, int64_t end) {
  rethrow_error();
  {
    auto lock = queue_.lock();
    busy_[slot_] = true;
    queue_.submit_locked(Out{slot_, base_, begin, end});
  }
  queue_.notify();
  slot_ = 1 - slot_;
}

void DirectWriter::take_buffer() {
  {
    auto lock = queue_.lock();
    queue_.wait(lock, [&] { return !busy_[slot_] || queue_.error_locked(); });
  }
  rethrow_error();
  if (buffers_[slot_] == nullptr &&
      ::posix_memalign(reinterpret_cast<void**>(&buffers_[slot_]), kPage, capacity_) != 0) {
    buffers_[slot_] = nullptr;
    throw CheckpointError("fsdp: cannot allocate a " + std::to_string(capacity_) + "-byte write buffer for " + path_);
  }
}

void DirectWriter::write(const void* data, int64_t bytes, int64_t offset) {
  if (bytes <= 0) return;
  if (fill_ > head_ && offset != base_ + fill_) {  // not a continuation: the run so far goes out
    send(head_, fill_);
    head_ = fill_ = 0;
  }
  if (fill_ == head_) {  // a new run, staged from the start of its first page
    take_buffer();
    base_ = round_down(offset);
    head_ = fill_ = offset - base_;
  }
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const int64_t n = std::min(bytes, capacity_ - fill_);
    std::memcpy(buffers_[slot_] + fill_, p, static_cast<size_t>(n));
    fill_ += n;
    p += n;
    bytes -= n;
    if (fill_ == capacity_) {  // the run goes on past the buffer: its staged pages go out
      send(head_, fill_);
      base_ += capacity_;
      head_ = fill_ = 0;
      if (bytes > 0) take_buffer();
    }
  }
}

// Staged bytes [begin, end) of a buffer: the whole pages among them directly, the partial ones at
// either end through the page cache.
void DirectWriter::write_out(const Out& o) {
  const char* buffer = buffers_[o.slot];
  const int64_t a = round_up(o.begin), b = round_down(o.end);
  if (direct_fd_ < 0 || b <= a) {
    pwrite_all(fd_, buffer + o.begin, o.end - o.begin, o.base + o.begin);
    return;
  }
  if (o.begin < a) pwrite_all(fd_, buffer + o.begin, a - o.begin, o.base + o.begin);
  pwrite_all(direct_fd_, buffer + a, b - a, o.base + a);
  if (b < o.end) pwrite_all(fd_, buffer + b, o.end - b, o.base + b);
}

void DirectWriter::pwrite_all(int fd, const char* data, int64_t bytes, int64_t offset) {
  const bool direct = fd == direct_fd_;
  (direct ? counters_.direct_bytes : counters_.buffered_bytes) += bytes;
  ++(direct ? counters_.direct_writes : counters_.buffered_writes);
  const Transfer t = pwrite_full(fd, data, static_cast<uint64_t>(bytes), static_cast<uint64_t>(offset));
  const auto done = static_cast<int64_t>(t.bytes);
  if (t.error == EINVAL && direct) {  // the file system refused direct I/O after all
    ::close(direct_fd_);
    direct_fd_ = -1;
    counters_.direct_bytes -= bytes - done;
    --counters_.direct_writes;
    pwrite_all(fd_, data + done, bytes - done, offset + done);
    return;
  }
  if (t.error != 0) throw CheckpointError("fsdp: write failed on " + path_ + ": " + std::strerror(t.error));
  if (done < bytes) throw CheckpointError("fsdp: write failed on " + path_ + ": no bytes written");
}

void DirectWriter::finish() {
  if (fill_ > head_) send(head_, fill_);
  head_ = fill_ = 0;
  queue_.wait_idle();
  rethrow_error();
  if (::fsync(fd_) != 0) throw CheckpointError("fsdp: fsync failed on " + path_ + ": " + std::strerror(errno));
  const int fd = fd_, direct_fd = direct_fd_;
  fd_ = direct_fd_ = -1;
  if (direct_fd >= 0) ::close(direct_fd);
  if (::close(fd) != 0) throw CheckpointError("fsdp: close failed on " + path_ + ": " + std::strerror(errno));
}

}  // namespace fsdp::io
