#include "comm/shm_channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "comm/transport.h"
#include "fsdp/errors.h"

namespace fsdp {

// Note [Shared-memory hops]
// Ranks of one host exchange the ring's chunks through shared memory instead of TCP over loopback:
// no system call per message and no trip through the kernel's network stack, one copy into a slot
// and one copy (or add) out of it. Each rank creates the segment of its incoming hop (from the
// previous rank of the ring); the previous rank opens it, and the creator unlinks the name as soon
// as both have it mapped, so /dev/shm holds nothing while training runs and nothing after any exit,
// SIGKILL included. A rank killed in the short window between creating and unlinking leaves a
// segment whose name carries its pid; remove_stale_shm_segments() deletes those at the next
// start. The slots form a single-producer, single-consumer queue: `written` and `consumed` count
// slots (unsigned 32-bit, compared by difference). A waiting side spins briefly, then sleeps on the
// counter's futex in short slices, between which it checks the deadline (the collective timeout),
// the peer's `closed` flag (set when the peer's transport fails or is destroyed) and that the
// peer's process still exists, so a dead peer is reported within a slice, a stopped one at the
// deadline. The counters' release/acquire order publishes the slot's bytes. Each slot carries the
// identity of the collective it belongs to (`ids`, Note [Collective identity in the framing] in
// ring.cpp), checked by the receiver before it touches the bytes. A side that fails writes the
// first line of its error into `reason` before setting `closed`, so the peer says why.
struct ShmChannel::Header {
  uint64_t magic;
  int32_t receiver_pid;
  std::atomic<int32_t> sender_pid;
  alignas(64) std::atomic<uint32_t> written;
  alignas(64) std::atomic<uint32_t> consumed;
  alignas(64) std::atomic<uint32_t> closed;
  std::atomic<int32_t> sender_waiting_for;
  WireId ids[kSlots];
  std::atomic<uint32_t> reason_taken;
  char reason[1024];
};

namespace {

constexpr uint64_t kMagic = 0x6673647073686d32ULL;  // "fsdpshm2"
constexpr size_t kHeaderBytes = 4096;
constexpr auto kSlice = std::chrono::milliseconds(5);

size_t segment_bytes() { return kHeaderBytes + ShmChannel::kSlots * ShmChannel::kSlotBytes; }

std::string errno_text(int err) { return std::strerror(err); }

void futex_wait(const std::atomic<uint32_t>& word, uint32_t seen, std::chrono::nanoseconds slice) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000000000);
  // The segment is shared between processes: no FUTEX_PRIVATE_FLAG.
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

bool process_exists(pid_t pid) { return pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH; }

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

std::string shm_host_key(const std::string& override_id) {
  if (!override_id.empty()) return "id:" + override_id;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  struct stat st {};
  const bool has_shm = ::stat("/dev/shm", &st) == 0;
  std::ostringstream key;
  key << host << '|' << read_first_line("/proc/sys/kernel/random/boot_id") << '|'
      << (has_shm ? std::to_string(st.st_dev) : "no-dev-shm");
  return key.str();
}

int remove_stale_shm_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const std::string prefix = kShmSegmentPrefix;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid <= 0 || process_exists(static_cast<pid_t>(pid))) continue;
    if (::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  ::closedir(dir);
  return removed;
}

std::unique_ptr<ShmChannel> ShmChannel::create(const std::string& tag, int peer, int self) {
  static_assert(sizeof(Header) <= kHeaderBytes, "the channel header fits its page");
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  std::ostringstream name;
  name << '/' << kShmSegmentPrefix << ::getpid() << '-' << std::hex << rd() << '-' << counter++ << '-' << tag;
  const std::string n = name.str();
  const int fd = ::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw DistError("fsdp: cannot create shared-memory segment " + n + ": " + errno_text(errno));
  // Reserve the pages now: on a full /dev/shm a later touch would be SIGBUS, not an error.
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(segment_bytes()));
  void* base = err == 0 ? ::mmap(nullptr, segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int map_err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(n.c_str());
    throw DistError("fsdp: cannot reserve " + std::to_string(segment_bytes()) + " bytes of shared memory for " + n +
                    ": " + errno_text(err != 0 ? err : map_err) +
                    " (is /dev/shm full or too small? enlarge it, e.g. docker --shm-size, or set "
                    "FSDP_CPU_TRANSPORT=gloo)");
  }
  auto* h = new (base) Header();
  h->receiver_pid = ::getpid();
  h->sender_pid.store(0);
  h->sender_waiting_for.store(-1);
  h->magic = kMagic;
  return std::unique_ptr<ShmChannel>(new ShmChannel(n, peer, self, base, segment_bytes(), /*owner=*/true));
}

std::unique_ptr<ShmChannel> ShmChannel::open(const std::string& name, int peer, int self) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw DistError("fsdp: cannot open shared-memory segment " + name + " of rank " + std::to_string(peer) + ": " +
                    errno_text(errno) + " (ranks on one host that do not share /dev/shm: set FSDP_CPU_TRANSPORT=gloo)");
  }
  struct stat st {};
  const bool sized = ::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == segment_bytes();
  void* base = sized ? ::mmap(nullptr, segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (base == MAP_FAILED || static_cast<Header*>(base)->magic != kMagic) {
    if (base != MAP_FAILED) ::munmap(base, segment_bytes());
    throw DistError("fsdp: shared-memory segment " + name + " of rank " + std::to_string(peer) +
                    " is not a channel of this version");
  }
  auto channel = std::unique_ptr<ShmChannel>(new ShmChannel(name, peer, self, base, segment_bytes(), /*owner=*/false));
  channel->header_->sender_pid.store(::getpid());
  return channel;
}

ShmChannel::ShmChannel(std::string name, int peer, int self, void* base, size_t size, bool owner)
    : name_(std::move(name)),
      peer_(peer),
      self_(self),
      base_(base),
      size_(size),
      owner_(owner),
      linked_(owner),
      ids_on_(collective_ids_enabled()),
      header_(static_cast<Header*>(base)) {}

ShmChannel::~ShmChannel() {
  close();
  unlink();
  ::munmap(base_, size_);
}

void ShmChannel::unlink() {
  if (!linked_) return;
  ::shm_unlink(name_.c_str());
  linked_ = false;
}

void ShmChannel::set_sender_waiting_for(int rank) { header_->sender_waiting_for.store(rank); }

void ShmChannel::close(const std::string& reason) {
  // The first side to close with a reason writes it; `closed` (set after) publishes it.
  if (!reason.empty() && header_->reason_taken.exchange(1) == 0) {
    const size_t n = std::min(reason.size(), sizeof(header_->reason) - 1);
    std::memcpy(header_->reason, reason.data(), n);
    header_->reason[n] = '\0';
  }
  header_->closed.store(1);
  futex_wake(header_->written);
  futex_wake(header_->consumed);
}

uint8_t* ShmChannel::slot(uint32_t index) const {
  return static_cast<uint8_t*>(base_) + kHeaderBytes + (index % kSlots) * kSlotBytes;
}

void ShmChannel::check_peer(const char* what) {
  const std::string side = std::string(what) + " rank " + std::to_string(peer_);
  if (header_->closed.load() != 0) {
    const int upstream = owner_ ? header_->sender_waiting_for.load() : -1;
    std::string why;
    if (header_->reason_taken.load() != 0) {
      why = std::string(header_->reason, strnlen(header_->reason, sizeof(header_->reason)));
    }
    throw PeerError(peer_, "shared-memory " + side + " failed: the channel was closed (the peer failed or exited" +
                               (upstream >= 0 ? " while waiting for rank " + std::to_string(upstream) : "") + ")" +
                               (why.empty() ? "" : ": " + why));
  }
  const pid_t pid = owner_ ? header_->sender_pid.load() : header_->receiver_pid;
  if (!process_exists(pid)) {
    throw PeerError(
        peer_, "shared-memory " + side + " failed: the peer's process (pid " + std::to_string(pid) + ") has exited");
  }
}

void ShmChannel::wait_until(const std::atomic<uint32_t>& word, const std::function<bool()>& ready,
                            std::chrono::steady_clock::time_point deadline, const char* what) {
  for (int spin = 0; spin < 200; ++spin) {
    if (ready()) return;
    if (spin >= 100) std::this_thread::yield();
  }
  for (;;) {
    const uint32_t seen = word.load();
    if (ready()) return;
    check_peer(what);
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      const int upstream = owner_ ? header_->sender_waiting_for.load() : -1;
      throw PeerError(
          peer_,
          std::string("shared-memory ") + what + " rank " + std::to_string(peer_) + ": Timed out: the peer did not " +
              (owner_ ? "send" : "receive") + " within the collective timeout" +
              (upstream >= 0
                   ? "; it is itself waiting for rank " + std::to_string(upstream) + " (is that one stopped or stuck?)"
                   : " (is it stopped or stuck?)"),
          /*timed_out=*/true);
    }
    futex_wait(word, seen, std::min<std::chrono::nanoseconds>(kSlice, deadline - now));
  }
}

void ShmChannel::write(const void* data, size_t bytes, const WireId& id,
                       std::chrono::steady_clock::time_point deadline) {
  if (bytes > kSlotBytes) {
    throw DistError("fsdp: shared-memory send of " + std::to_string(bytes) + " bytes exceeds a slot (" +
                    std::to_string(kSlotBytes) + ")");
  }
  const uint32_t w = header_->written.load(std::memory_order_relaxed);
  wait_until(
      header_->consumed, [&] { return w - header_->consumed.load(std::memory_order_acquire) < kSlots; }, deadline,
      "send to");
  std::memcpy(slot(w), data, bytes);
  WireId& carried = header_->ids[w % kSlots];
  if (ids_on_) carried = id;
  carried.piece = static_cast<uint32_t>(bytes);
  header_->written.store(w + 1, std::memory_order_release);
  futex_wake(header_->written);
}

void ShmChannel::read(size_t bytes, const WireId& expected, const std::function<void(const void* data)>& consume,
                      std::chrono::steady_clock::time_point deadline) {
  const uint32_t c = header_->consumed.load(std::memory_order_relaxed);
  wait_until(
      header_->written, [&] { return header_->written.load(std::memory_order_acquire) != c; }, deadline,
      "receive from");
  // A copy: the peer's bytes are checked, then used, never trusted in place.
  const WireId got = header_->ids[c % kSlots];
  if (ids_on_ && !got.same_collective(expected))
    throw CollectiveMismatch(peer_, mismatch_text(self_, expected, peer_, got));
  if (got.piece != bytes) {
    throw CollectiveMismatch(peer_, "shared-memory receive from rank " + std::to_string(peer_) + ": its slot of " +
                                        expected.describe() + " holds " + std::to_string(got.piece) +
                                        " bytes where this rank expects " + std::to_string(bytes) +
                                        " (a corrupted or foreign channel)");
  }
  consume(slot(c));
  header_->consumed.store(c + 1, std::memory_order_release);
  futex_wake(header_->consumed);
}

}  // namespace fsdp
