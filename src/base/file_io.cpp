// See file_io.h.
#include "base/file_io.h"
#include "base/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <dirent.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "fsdp/errors.h"

namespace fsdp::io {
namespace {

struct Locks {  // the lock files this process holds (try_lock_file)
  std::mutex mutex;
  std::set<std::pair<dev_t, ino_t>> held;
};
Locks& locks() {
  static Locks* l = new Locks;  // never destroyed: a save may release its lock during exit
  return *l;
}

[[noreturn]] void fail(const std::string& what, const std::string& path, int err) {
  throw CheckpointError("fsdp: " + what + " " + path + ": " + std::strerror(err));
}

// pread or pwrite (`call`) until `bytes` have moved, a call fails or a call moves nothing.
template <class Call>
Transfer transfer_full(Call call, uint64_t bytes, uint64_t offset) {
  Transfer t;
  while (t.bytes < bytes) {
    const ssize_t n = call(t.bytes, bytes - t.bytes, static_cast<off_t>(offset + t.bytes));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      t.error = errno;
      break;
    }
    if (n == 0) break;
    t.bytes += static_cast<uint64_t>(n);
  }
  return t;
}

}  // namespace

Transfer pread_full(int fd, void* data, uint64_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(data);
  return transfer_full([&](uint64_t done, uint64_t left, off_t at) { return ::pread(fd, p + done, left, at); }, bytes,
                       offset);
}

Transfer pwrite_full(int fd, const void* data, uint64_t bytes, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  return transfer_full([&](uint64_t done, uint64_t left, off_t at) { return ::pwrite(fd, p + done, left, at); }, bytes,
                       offset);
}

File File::open_read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open", path, errno);
  return File(fd, path);
}

File File::open_write(const std::string& path, bool create_truncate) {
  const int flags = O_WRONLY | O_CLOEXEC | (create_truncate ? O_CREAT | O_TRUNC : 0);
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) fail("cannot open for writing", path, errno);
  return File(fd, path);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::pwrite_all(const void* data, uint64_t bytes, uint64_t offset) {
  const Transfer t = pwrite_full(fd_, data, bytes, offset);
  if (t.error != 0) fail("write failed on", path_, t.error);
  if (t.bytes < bytes) throw CheckpointError("fsdp: write failed on " + path_ + ": no bytes written");
}

void File::pread_all(void* data, uint64_t bytes, uint64_t offset) const {
  const Transfer t = pread_full(fd_, data, bytes, offset);
  if (t.error != 0) fail("read failed on", path_, t.error);
  if (t.bytes < bytes) {
    throw CheckpointError("fsdp: unexpected end of file in " + path_ + " at byte " + std::to_string(offset + t.bytes));
  }
}

void File::truncate(uint64_t size) {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) fail("cannot size", path_, errno);
}

void File::sync() {
  if (::fsync(fd_) != 0) fail("fsync failed on", path_, errno);
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close failed on", path_, errno);
}

uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("cannot stat", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open directory", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail("fsync failed on directory", dir, err);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    File f = File::open_write(tmp, true);
    f.pwrite_all(text.data(), text.size(), 0);
    f.sync();
    f.close();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename " + tmp + " to", path, errno);
  fsync_dir(parent_dir(path));
}

std::string read_small_file(const std::string& path, uint64_t limit) {
  File f = File::open_read(path);
  const uint64_t n = f.size();
  if (n > limit)
    throw CheckpointError("fsdp: " + path + " is " + std::to_string(n) + " bytes, over the limit of " +
                          std::to_string(limit));
  std::string text(n, '\0');
  if (n > 0) f.pread_all(text.data(), n, 0);
  return text;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty() || (!b.empty() && b.front() == '/')) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string parent_dir(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_dir(path)) return;
  make_dirs(parent_dir(path));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create directory", path, errno);
  if (!is_dir(path)) throw CheckpointError("fsdp: " + path + " exists and is not a directory");
}

std::vector<std::string> list_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) fail("cannot list directory", dir, errno);
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail("cannot stat", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : list_dir(path)) remove_tree(join(path, name));
    if (::rmdir(path.c_str()) != 0) fail("cannot remove directory", path, errno);
  } else if (::unlink(path.c_str()) != 0) {
    fail("cannot remove", path, errno);
  }
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("cannot rename " + from + " to", to, errno);
}

std::shared_ptr<void> try_lock_file(const std::string& path, bool create) {
  std::lock_guard<std::mutex> guard(locks().mutex);
  struct stat st {};
  if (!create && (::stat(path.c_str(), &st) != 0 || locks().held.count({st.st_dev, st.st_ino}) != 0)) return nullptr;
  if (create) File::open_write(path, true).close();  // throws naming the path and the reason
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  const bool locked = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (fd < 0 || ::fstat(fd, &st) != 0 || (!locked && !create)) {
    if (fd >= 0) ::close(fd);
    return nullptr;
  }
  const std::pair<dev_t, ino_t> id{st.st_dev, st.st_ino};
  locks().held.insert(id);
  return std::shared_ptr<void>(&locks(), [fd, id](void*) {  // not null: a lock held
    std::lock_guard<std::mutex> release(locks().mutex);
    locks().held.erase(id);
    ::close(fd);
  });
}

}  // namespace fsdp::io
