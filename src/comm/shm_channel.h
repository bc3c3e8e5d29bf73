// Shared-memory channels between ranks on one host: the hops of the CPU ring that stay on the
// machine (Note [Shared-memory hops] in shm_channel.cpp). A channel carries bytes one way, from a
// sender to a receiver, through a few fixed slots in a POSIX shared-memory segment; each side
// waits on a futex, bounded by a deadline, while checking that the peer process is alive and has
// not closed the channel.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "comm/transport.h"

namespace fsdp {

// What identifies a host for shared memory: ranks with equal keys can map each other's segments.
// The hostname, the kernel's boot id and the device of /dev/shm (so ranks in separate mount
// namespaces do not match); `override_id`, when not empty, replaces all of it.
std::string shm_host_key(const std::string& override_id);

// Removes segments this library left in /dev/shm from processes that no longer exist (a rank
// SIGKILLed between creating a segment and unlinking it). Returns how many were removed.
int remove_stale_shm_segments();

// The prefix of every segment name this library creates (shown in /dev/shm without the slash).
constexpr const char* kShmSegmentPrefix = "fsdp-shm-";

class ShmChannel {
 public:
  static constexpr int kSlots = 4;
  static constexpr size_t kSlotBytes = size_t{512} << 10;

  // The receiver creates the segment (named /fsdp-shm-<pid>-<tag>) and publishes its name; the
  // sender opens it; the receiver unlinks the name once the sender has it mapped, so nothing is
  // left in /dev/shm even if a process is killed later. Both throw DistError with the errno text.
  // `peer` and `self` are group ranks, for errors.
  static std::unique_ptr<ShmChannel> create(const std::string& tag, int peer, int self);
  static std::unique_ptr<ShmChannel> open(const std::string& name, int peer, int self);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  const std::string& name() const { return name_; }
  void unlink();  // removes the name from /dev/shm (idempotent)

  // Sender: copies `bytes` (at most kSlotBytes) into the next slot, waiting for a free one; the
  // slot carries `id` (the collective it belongs to) and its byte count.
  void write(const void* data, size_t bytes, const WireId& id, std::chrono::steady_clock::time_point deadline);
  // Receiver: waits for the next slot and checks that it belongs to collective `expected` and
  // holds `bytes`; then hands its bytes to `consume` and frees the slot. A slot of another
  // collective throws CollectiveMismatch naming both and is left unread.
  void read(size_t bytes, const WireId& expected, const std::function<void(const void* data)>& consume,
            std::chrono::steady_clock::time_point deadline);
  // Marks the channel closed: the peer's waits fail at once instead of at their deadline, with
  // `reason` (the first line of this side's error, if any) in their message.
  void close(const std::string& reason = "");
  // Sender: tells the receiver, for its error messages, that the sender is itself blocked waiting
  // for `rank` (-1: not blocked), so a rank that times out can name the rank really at fault.
  void set_sender_waiting_for(int rank);

 private:
  struct Header;
  ShmChannel(std::string name, int peer, int self, void* base, size_t size, bool owner);
  void wait_until(const std::atomic<uint32_t>& word, const std::function<bool()>& ready,
                  std::chrono::steady_clock::time_point deadline, const char* what);
  void check_peer(const char* what);
  uint8_t* slot(uint32_t index) const;

  std::string name_;
  int peer_;  // the peer's group rank, for errors
  int self_;  // this rank's group rank, for errors
  void* base_;
  size_t size_;
  bool owner_;  // the receiver, which created the name
  bool linked_;
  bool ids_on_;  // collective_ids_enabled()
  Header* header_;
};

}  // namespace fsdp
