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
    : path_(path), capacity_(std::max(round_up(buffer_bytes), kPage)) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) throw CheckpointError("fsdp: cannot open for writing " + path + ": " + std::strerror(errno));
  direct_fd_ = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);  // -1 where refused: buffered
}

DirectWriter::~DirectWriter() {
  std::free(buffer_);
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

void DirectWriter::write(const void* data, int64_t bytes, int64_t offset) {
  if (bytes <= 0) return;
  if (fill_ > head_ && offset != base_ + fill_) {  // not a continuation: the run so far goes out
    write_out(head_, fill_);
    head_ = fill_ = 0;
  }
  if (fill_ == head_) {  // a new run, staged from the start of its first page
    base_ = round_down(offset);
    head_ = fill_ = offset - base_;
  }
  if (buffer_ == nullptr && ::posix_memalign(reinterpret_cast<void**>(&buffer_), kPage, capacity_) != 0) {
    buffer_ = nullptr;
    throw CheckpointError("fsdp: cannot allocate a " + std::to_string(capacity_) + "-byte write buffer for " + path_);
  }
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const int64_t n = std::min(bytes, capacity_ - fill_);
    std::memcpy(buffer_ + fill_, p, static_cast<size_t>(n));
    fill_ += n;
    p += n;
    bytes -= n;
    if (fill_ == capacity_) {  // the run goes on past the buffer: its staged pages go out
      write_out(head_, fill_);
      base_ += capacity_;
      head_ = fill_ = 0;
    }
  }
}

// Staged bytes [begin, end): the whole pages among them directly, the partial ones at either end
// through the page cache.
void DirectWriter::write_out(int64_t begin, int64_t end) {
  const int64_t a = round_up(begin), b = round_down(end);
  if (direct_fd_ < 0 || b <= a) {
    pwrite_all(fd_, buffer_ + begin, end - begin, base_ + begin);
    return;
  }
  if (begin < a) pwrite_all(fd_, buffer_ + begin, a - begin, base_ + begin);
  pwrite_all(direct_fd_, buffer_ + a, b - a, base_ + a);
  if (b < end) pwrite_all(fd_, buffer_ + b, end - b, base_ + b);
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
  if (fill_ > head_) write_out(head_, fill_);
  head_ = fill_ = 0;
  if (::fsync(fd_) != 0) throw CheckpointError("fsdp: fsync failed on " + path_ + ": " + std::strerror(errno));
  const int fd = fd_, direct_fd = direct_fd_;
  fd_ = direct_fd_ = -1;
  if (direct_fd >= 0) ::close(direct_fd);
  if (::close(fd) != 0) throw CheckpointError("fsdp: close failed on " + path_ + ": " + std::strerror(errno));
}

}  // namespace fsdp::io
