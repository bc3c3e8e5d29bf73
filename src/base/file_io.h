// Small POSIX file helpers (checkpoints, the disk tier, the tools): positioned reads and writes that loop until done,
// fsync of files and directories, and errors that name the path and the system's reason.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::io {

// The one loop of positioned reads and writes (File, DirectWriter, the safetensors header reader,
// the disk tier's I/O threads): pread / pwrite on `fd` until `bytes` bytes at `offset` have moved,
// retrying short transfers and EINTR. Throws nothing: it returns the bytes moved and, when fewer,
// `error`, the errno of the call that failed, or 0 when a call moved nothing (end of file).
struct Transfer {
  uint64_t bytes = 0;
  int error = 0;
};
Transfer pread_full(int fd, void* data, uint64_t bytes, uint64_t offset);
Transfer pwrite_full(int fd, const void* data, uint64_t bytes, uint64_t offset);

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
  int fd() const { return fd_; }

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// Bytes [at, at + bytes) of a buffer that come from `file` at byte `offset` (a read that takes some
// of its bytes from other files than its own).
struct FileRange {
  int64_t at = 0, bytes = 0, offset = 0;
  std::shared_ptr<const File> file;
};

void fsync_dir(const std::string& dir);
// Writes `text` to `path` through path.tmp + fsync + rename + fsync of the directory.
void write_file_atomic(const std::string& path, const std::string& text);
std::string read_small_file(const std::string& path, uint64_t limit = 64 << 20);
bool exists(const std::string& path);
bool is_dir(const std::string& path);
std::string join(const std::string& a, const std::string& b);
std::string parent_dir(const std::string& path);
// mkdir -p.
void make_dirs(const std::string& path);
// rm -rf; a missing path is fine.
void remove_tree(const std::string& path);
void rename_path(const std::string& from, const std::string& to);
// Names in a directory, without "." and "..", sorted.
std::vector<std::string> list_dir(const std::string& dir);

// Note [No std::filesystem next to libtorch.so]
// The torch wheel's libtorch.so exports its own copy of std::filesystem's out-of-line functions
// (remove_all, directory iteration, ...), built against another libstdc++. Calls from our code
// bind to those copies and can crash (std::filesystem::remove_all jumped to address 0 here). So
// fsdp, and its tests, do file-system work through the POSIX helpers above.

}  // namespace fsdp::io
