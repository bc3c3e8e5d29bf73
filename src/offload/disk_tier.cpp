// The disk tier's files and mappings: creation with reserved blocks, the residency controls the
// streamed optimizer step uses, and its test hooks (tier_hooks.h). See Note [Disk tier residency] in disk_tier.h.
#include "base/strings.h"
#include "offload/disk_tier.h"
#include "offload/tier_hooks.h"
#include "offload/tier_rules.h"
#include "sysinfo/sysinfo.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "base/file_io.h"
#include "fsdp/errors.h"

namespace fsdp::offload {

namespace {

constexpr int64_t kPage = 4096;

void delete_mapping(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  m->tier->remove(m);
  ::munmap(m->base, m->bytes);
  ::close(m->fd);
  if (m->direct_fd >= 0) ::close(m->direct_fd);
  delete m;
}

std::string mib(int64_t bytes) { return std::to_string(bytes) + " bytes (" + base::mib(bytes, 1) + ")"; }

// The page-aligned byte range [lo, hi) of the mapping under elements [begin, end) of t.
bool byte_range(const at::Tensor& t, int64_t begin, int64_t end, Mapping*& m, int64_t& lo, int64_t& hi) {
  m = mapping_of(t);
  if (m == nullptr || end <= begin) return false;
  const int64_t first = static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(m->base);
  lo = (first + begin * static_cast<int64_t>(t.element_size())) / kPage * kPage;
  // Whole pages, the file's last one included (its blocks are reserved to a page boundary):
  // POSIX_FADV_DONTNEED leaves a partial page in the cache.
  const int64_t file_end = (static_cast<int64_t>(m->bytes) + kPage - 1) / kPage * kPage;
  hi = std::min<int64_t>(file_end, (first + end * static_cast<int64_t>(t.element_size()) + kPage - 1) / kPage * kPage);
  return hi > lo;
}

}  // namespace

Mapping* mapping_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const auto& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &delete_mapping) return nullptr;
  return static_cast<Mapping*>(dp.get_context());
}

std::shared_ptr<DiskTier> DiskTier::open(const std::string& dir, int64_t budget_bytes) {
  if (dir.empty()) throw ConfigError("fsdp: offload.dir is empty; name a directory for the disk tier");
  try {
    io::make_dirs(dir);
  } catch (const Error& e) {
    throw OffloadError("fsdp: offload.dir " + dir + " cannot be created: " + e.what());
  }
  // Prove the directory takes files and blocks now, not at the first optimizer step.
  const std::string probe = io::join(dir, ".fsdp-offload-probe-" + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw OffloadError("fsdp: offload.dir " + dir + " is not writable: cannot create " + probe + ": " +
                       std::strerror(errno) + "; make it writable or choose another offload.dir");
  }
  const int rc = ::posix_fallocate(fd, 0, kPage);
  ::unlink(probe.c_str());
  if (rc != 0) {
    ::close(fd);
    throw OffloadError("fsdp: offload.dir " + dir + ": cannot reserve blocks for the disk tier's files: " +
                       std::strerror(rc) + "; free space or choose another offload.dir");
  }
  // The tier's tensors are shared mappings of its files: a file system that cannot map them
  // (some network and FUSE file systems) is refused now, naming it.
  void* probe_map = hooks_for_new_tiers()->map_shared(fd, kPage);
  const int map_err = errno;
  ::close(fd);
  if (probe_map == MAP_FAILED) {
    throw OffloadError("fsdp: offload.dir " + dir + " is on a file system that cannot memory-map its files (mmap " +
                       "MAP_SHARED of " + probe + ": " + std::strerror(map_err) +
                       "); choose an offload.dir on a local file system (ext4, xfs, tmpfs)");
  }
  ::munmap(probe_map, kPage);
  return std::make_shared<FileTier>(dir, budget_bytes);
}

FileTier::~FileTier() { stop_io(); }

void FileTier::check_free_space(int64_t bytes, const std::string& what) const {
  const int64_t avail = sysinfo::free_disk_bytes(dir_);
  if (avail < 0) return;  // the reservation still guards
  if (avail < bytes) {
    throw OffloadError("fsdp: offload.dir " + dir_ + " has " + mib(avail) + " free but " + what + " needs " +
                       mib(bytes) + "; free space or choose another offload.dir");
  }
}

at::Tensor FileTier::zeros(int64_t numel, const std::string& what) {
  if (numel == 0) return at::zeros({0}, at::kFloat);
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // pid, tier and counter: unique across processes and across ranks run as threads of one.
    char name[96];
    std::snprintf(name, sizeof name, "fsdp-offload-%d-%p-%lld", static_cast<int>(::getpid()), static_cast<void*>(this),
                  static_cast<long long>(counter_++));
    path = io::join(dir_, name);
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw OffloadError("fsdp: offload.dir " + dir_ + ": cannot create a file for " + what + ": " +
                       std::strerror(errno) + "; make it writable or choose another offload.dir");
  }
  // The same file for direct transfers (Note [Disk tier I/O threads]); -1 where refused.
  const int direct_fd = ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  ::unlink(path.c_str());  // see Note [Disk tier residency]: nothing left behind on a crash
  // Reserve every block now (whole pages: direct transfers move whole pages): a write through
  // the mapping to a hole on a full disk is a SIGBUS.
  const int64_t reserved = (static_cast<int64_t>(bytes) + kPage - 1) / kPage * kPage;
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(reserved));
  if (rc != 0) {
    ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
    throw OffloadError("fsdp: offload.dir " + dir_ + ": cannot reserve " + mib(static_cast<int64_t>(bytes)) + " for " +
                       what + ": " + std::strerror(rc) + "; free space or choose another offload.dir");
  }
  void* base = hooks_->map_shared(fd, bytes);
  if (base == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
    throw OffloadError("fsdp: offload.dir " + dir_ + ": cannot map " + mib(static_cast<int64_t>(bytes)) + " for " +
                       what + ": " + std::strerror(err));
  }
  // No readahead on faults: what comes into memory is what the tier asks for (will_need), so the
  // budget holds (the kernel's default window alone is 128 KiB per fault).
  ::madvise(base, bytes, MADV_RANDOM);
  auto* m = new Mapping{shared_from_this(), base, bytes, fd, direct_fd};
  add(m);
  return at::for_blob(base, {numel})
      .context(m, &delete_mapping)
      .options(at::TensorOptions().dtype(at::kFloat))
      .make_tensor();
}

int64_t FileTier::chunk_elements(int tensors, const std::string& unit) const {
  const int64_t elems = offload::chunk_elements(budget_bytes_, tensors);  // offload/tier_rules.h
  if (elems < 1024) {
    const int64_t need = 3 * tensors * kPage;
    throw ConfigError("fsdp: offload.memory_budget_bytes=" + std::to_string(budget_bytes_) + " is smaller than " +
                      (unit.empty() ? std::string("a unit's") : "unit '" + unit + "''s") +
                      " working set in the optimizer step: " + std::to_string(need) + " bytes (three 4 KiB pages " +
                      "of each of its " + std::to_string(tensors) + " streamed tensors: read-ahead, current, " +
                      "write-behind); set offload.memory_budget_bytes to at least " + std::to_string(need));
  }
  return elems;
}

void FileTier::add(Mapping* m) {
  std::lock_guard<std::mutex> lock(mu_);
  mappings_.insert(m);
}

void FileTier::remove(Mapping* m) {
  wait_for_transfers(m);
  std::lock_guard<std::mutex> lock(mu_);
  mappings_.erase(m);
}

int64_t FileTier::file_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const Mapping* m : mappings_) {  // the blocks the files take (holes take none)
    struct stat st {};
    total += ::fstat(m->fd, &st) == 0 ? static_cast<int64_t>(st.st_blocks) * 512 : static_cast<int64_t>(m->bytes);
  }
  return total;
}

int64_t FileTier::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  std::vector<unsigned char> pages;
  for (const Mapping* m : mappings_) {
    pages.resize((m->bytes + kPage - 1) / kPage);
    if (::mincore(m->base, m->bytes, pages.data()) != 0) continue;
    for (unsigned char p : pages) total += (p & 1) ? kPage : 0;
  }
  return total;
}

void* TierHooks::map_shared(int fd, size_t bytes) const {
  return ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
}

bool is_disk_backed(const at::Tensor& t) { return mapping_of(t) != nullptr; }

FileTier* file_tier_of(const at::Tensor& t) {
  Mapping* m = mapping_of(t);
  return m ? m->tier.get() : nullptr;
}

DiskTier* tier_of(const at::Tensor& t) { return file_tier_of(t); }

void write_behind(const at::Tensor& t, int64_t begin, int64_t end) {
  Mapping* m;
  int64_t lo, hi;
  if (!byte_range(t, begin, end, m, lo, hi)) return;
  ::sync_file_range(m->fd, lo, hi - lo, SYNC_FILE_RANGE_WRITE);
}

void release(const at::Tensor& t, int64_t begin, int64_t end) {
  if (end < 0) end = t.defined() ? t.numel() : 0;
  Mapping* m;
  int64_t lo, hi;
  if (!byte_range(t, begin, end, m, lo, hi)) return;
  // Unmap (dirty bits move to the page cache), wait for the range's writeback (started by
  // write_behind a chunk earlier, so mostly done), then drop the now clean pages from the cache.
  ::madvise(static_cast<char*>(m->base) + lo, static_cast<size_t>(hi - lo), MADV_DONTNEED);
  ::sync_file_range(m->fd, lo, hi - lo,
                    SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
  ::posix_fadvise(m->fd, lo, hi - lo, POSIX_FADV_DONTNEED);
}

void punch_hole(const at::Tensor& t, int64_t begin, int64_t end) {
  Mapping* m = mapping_of(t);
  if (m == nullptr) return;
  const int64_t first = static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(m->base);
  const int64_t lo = (first + begin + kPage - 1) / kPage * kPage, hi = (first + end) / kPage * kPage;
  if (hi <= lo) return;
  ::madvise(static_cast<char*>(m->base) + lo, static_cast<size_t>(hi - lo), MADV_DONTNEED);
  // A file system without holes keeps the blocks: the reads are the same, the disk holds more.
  ::fallocate(m->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, lo, hi - lo);
}

void reserve_blocks(const at::Tensor& t, const std::string& what) {
  Mapping* m = mapping_of(t);
  if (m == nullptr) return;
  const int rc = ::posix_fallocate(m->fd, 0, static_cast<off_t>(whole_pages(static_cast<int64_t>(m->bytes))));
  if (rc != 0) {
    throw OffloadError("fsdp: offload.dir " + m->tier->dir() + ": cannot reserve " +
                       mib(static_cast<int64_t>(m->bytes)) + " for " + what + ": " + std::strerror(rc) +
                       "; free space or choose another offload.dir");
  }
}

at::Tensor zeros_in_tier(const at::Tensor& t, const std::string& what) {
  if (FileTier* tier = file_tier_of(t)) return tier->zeros(t.numel(), what).view(t.sizes());
  return at::zeros_like(t);
}

void copy_streamed(const at::Tensor& dst_in, const at::Tensor& src_in) {
  FileTier* tier = file_tier_of(dst_in) ? file_tier_of(dst_in) : file_tier_of(src_in);
  c10::NoGradGuard no_grad;
  if (tier == nullptr || src_in.scalar_type() != at::kFloat || dst_in.scalar_type() != at::kFloat) {
    dst_in.copy_(src_in);
    return;
  }
  if (FileTier* into = file_tier_of(dst_in)) into->bump_generation();  // reads issued before are stale
  // Through the I/O threads on both sides (Note [Disk tier I/O threads]): a disk-tier source is
  // read ahead in whole pages, and each chunk is written by the destination's tier (or copied into
  // memory); neither mapping is paged through.
  const at::Tensor src = src_in.reshape({-1});
  const int64_t chunk = tier->chunk_elements(2);
  RangeWriter writer(dst_in, "a copy in the disk tier");
  read_streamed(src, 0, src.numel(), "a copy in the disk tier", [&](const float* data, int64_t at, int64_t count) {
    for (int64_t a = 0; a < count; a += chunk) {
      const int64_t n = std::min(chunk, count - a);
      at::Tensor part = at::empty({n}, at::kFloat);
      std::memcpy(part.data_ptr<float>(), data + a, static_cast<size_t>(n) * sizeof(float));
      writer.put(at + a, part);
    }
  });
  writer.finish();
  release(src_in);
  release(dst_in);
}

at::Tensor clone_in_tier(const at::Tensor& t) {
  if (!t.is_cpu()) return t.to(at::kCPU);  // a snapshot of a device shard waits in host memory
  FileTier* tier = file_tier_of(t);
  if (tier == nullptr) return t.clone();
  at::Tensor out = tier->zeros(t.numel(), "a checkpoint snapshot");
  copy_streamed(out, t);
  return out.view(t.sizes());
}

}  // namespace fsdp::offload
