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

// A transport failure that involves a known peer (a group rank).
class PeerError : public DistError {
 public:
  PeerError(int peer, const std::string& what) : DistError(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

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
