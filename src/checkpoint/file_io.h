// Small POSIX file helpers for checkpoints: positioned reads and writes that loop until done,
// fsync of files and directories, and errors that name the path and the system's reason.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::checkpoint {

// An open file descriptor, closed on destruction.
class File {
 public:
  static File open_read(const std::string& path);
  static File open_write(const std::string& path, bool create_truncate);
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  ~File();

  void pwrite_all(const void* data, uint64_t bytes, uint64_t offset);
  void pread_all(void* data, uint64_t bytes, uint64_t offset) const;
  void truncate(uint64_t size);
  void sync();
  void close();
  uint64_t size() const;
  const std::string& path() const { return path_; }

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

void fsync_dir(const std::string& dir);
// Writes `text` to `path` through path.tmp + fsync + rename + fsync of the directory.
void write_file_atomic(const std::string& path, const std::string& text);
std::string read_small_file(const std::string& path, uint64_t limit = 64 << 20);
bool exists(const std::string& path);
std::string join(const std::string& a, const std::string& b);

}  // namespace fsdp::checkpoint
