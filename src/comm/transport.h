// Transport: the backend interface under Communicator. A transport runs one collective to
// completion on the calling thread (the communicator's worker) and reports the bytes it moved.
// Implementations: LocalTransport (one rank), RingTransport (CPU: bandwidth-optimal rings whose
// hops are shared memory within a host and Gloo point-to-point between hosts), NcclTransport (CUDA
// builds: NCCL's native collectives).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include "fsdp/comm.h"
#include "fsdp/errors.h"

namespace c10d {
class Store;
}

namespace fsdp {

struct TransferCount {
  uint64_t sent = 0;
  uint64_t received = 0;
};

// A transport failure that involves a known peer (a group rank). `timed_out`: the peer did not
// answer within the collective timeout (the communicator reports it as TimeoutError).
class PeerError : public DistError {
 public:
  PeerError(int peer, const std::string& what, bool timed_out = false)
      : DistError(what), peer_(peer), timed_out_(timed_out) {}
  int peer() const { return peer_; }
  bool timed_out() const { return timed_out_; }

 private:
  int peer_;
  bool timed_out_;
};

// What one collective is, as the ranks compare it (Note [Collective identity in the framing] in
// ring.cpp): its sequence number on the communicator, kind, dtype, this rank's payload bytes and
// tag. The communicator hands it to the transport before each collective.
struct CollectiveId {
  uint64_t seq = 0;
  int kind = -1;   // CollectiveKind; -1 for the communicator's own exchanges
  int dtype = -1;  // at::ScalarType; -1 for none
  uint64_t bytes = 0;
  std::string tag;
  std::string describe() const;  // "reduce_scatter 'layers.0' (80 bytes of float) as collective #12"
};

// A collective identity as it travels: 128 bytes, the same layout on every rank. A tag longer
// than `tag` is compared through its hash and length.
struct WireId {
  uint64_t seq = 0;
  uint64_t bytes = 0;
  uint64_t tag_hash = 0;
  int32_t kind = -1;
  int32_t dtype = -1;
  uint32_t tag_len = 0;
  uint32_t piece = 0;  // shared memory: the bytes in this slot
  char tag[88] = {};

  static WireId of(const CollectiveId& id);
  bool same_collective(const WireId& other) const;
  std::string describe() const;
};
static_assert(sizeof(WireId) == 128, "WireId travels as 128 bytes");

// The previous rank's collective is not this rank's: no byte of it is used.
class CollectiveMismatch : public PeerError {
 public:
  using PeerError::PeerError;
};

// "this rank (rank R) runs X but rank P runs Y ...", with the likely cause.
std::string mismatch_text(int rank, const WireId& mine, int peer, const WireId& theirs);
// What ranks that issue different collectives most likely did, for every mismatch message.
extern const char* const kLikelyMismatchCause;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend_name() const = 0;
  // Where tensors this transport moves must live (the communicator's own small exchanges use it).
  virtual c10::Device device() const { return c10::Device(c10::kCPU); }

  virtual void all_gather(const at::Tensor& output, const at::Tensor& input, TransferCount& count) = 0;
  virtual void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, TransferCount& count) = 0;
  virtual void all_reduce(const at::Tensor& tensor, ReduceOp op, TransferCount& count) = 0;
  virtual void broadcast(const at::Tensor& tensor, int root, TransferCount& count) = 0;
  virtual void barrier(TransferCount& count) = 0;

  // The collective the next calls belong to. A transport whose messages carry it (the CPU ring)
  // fails with CollectiveMismatch as soon as a peer's differs; the others ignore it.
  virtual void begin(const CollectiveId& id) { (void)id; }
  virtual bool carries_ids() const { return false; }
};

struct CpuTransportOptions {
  std::chrono::milliseconds timeout{60000};
  int threads = 2;
  // Address this rank's Gloo device binds to; empty = from GLOO_SOCKET_IFNAME or the hostname.
  std::string hostname;
  // "auto": the ring's hops between ranks of one host go through shared memory, the others over
  // Gloo; "gloo": every hop over Gloo. FSDP_CPU_TRANSPORT in the environment overrides it.
  std::string mode = "auto";
  // Which ranks count as one host for shared memory: empty = detected (shm_host_key).
  std::string host_id;
};

std::unique_ptr<Transport> make_local_transport();
// How collective identities are checked (Note [Collective identity in the framing] in ring.cpp),
// from FSDP_COLLECTIVE_IDS: unset or "1", in the framing of a transport that carries them and in
// the communicator's queue for one that cannot (NCCL); "queue", in the queue on every transport
// (the CPU ring then carries none: this is how the NCCL path is tested on CPU); "0", not at all
// (to measure their cost). Anything else is a ConfigError.
enum class IdCheck { kAuto, kQueue, kOff };
IdCheck collective_id_check();
// Whether the CPU ring carries identities in its framing: collective_id_check() == kAuto.
bool collective_ids_enabled();
// Turns c10d's flight recorder off (once, unless the user configured it): Note [Flight recorder
// off] in ring.cpp. Call before making a c10d process group.
void disable_flight_recorder_once();
// CUDA tensors over NCCL (CUDA builds); the CPU-only build throws ConfigError naming the fix.
std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               std::chrono::milliseconds timeout);
// CPU collectives as rings (Note [Ring schedule] in ring.cpp) whose hops are shared-memory channels
// between ranks of one host and Gloo point-to-point between hosts (Note [Shared-memory hops]).
// Every rank of the group calls it with the same options; the ranks agree through `store`.
std::unique_ptr<Transport> make_cpu_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              const CpuTransportOptions& options);

}  // namespace fsdp
