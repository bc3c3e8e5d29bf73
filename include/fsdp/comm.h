// Communicator: the one place all fsdp communication goes through. Every collective is issued
// asynchronously onto the communicator's own ordered queue (so the order is the same on every
// rank by construction), is counted (bytes sent and received, time busy, time callers blocked),
// and every wait is bounded by a timeout whose error names the collective, the caller's tag and,
// when known, the peer.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

namespace fsdp {

enum class CollectiveKind : int {
  kAllGather = 0,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
};
constexpr int kNumCollectiveKinds = 5;
const char* collective_name(CollectiveKind kind);

enum class ReduceOp { kSum, kAvg };

// Counters for one kind of collective on one rank.
struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;      // payload bytes this rank put on the wire
  uint64_t bytes_received = 0;  // payload bytes this rank took off the wire
  double busy_s = 0;            // time the collective ran (issue to completion)
  double wait_s = 0;            // time callers were blocked in wait()
};

struct CommStats {
  std::array<OpStats, kNumCollectiveKinds> ops{};
  const OpStats& of(CollectiveKind kind) const { return ops[static_cast<int>(kind)]; }
  uint64_t total_bytes_sent() const;
  double total_wait_s() const;
  CommStats operator-(const CommStats& earlier) const;  // the counts between two snapshots
};

class Tracer;

// A handle on an issued collective; wait() blocks until it finishes (or throws its error).
// Waiting twice is a no-op. Dropping a handle without waiting is allowed: the collective still
// runs, and its error, if any, surfaces at the next collective on the same communicator.
class CommHandle {
 public:
  CommHandle() = default;
  void wait();
  bool is_completed() const;

  struct Pending;  // the issued collective; defined in the library (src/comm/communicator.cpp)

 private:
  friend class Communicator;
  explicit CommHandle(std::shared_ptr<Pending> pending);
  std::shared_ptr<Pending> pending_;
};

// A group of ranks that runs collectives together. Communicators are made by the library, never
// by users: Dist::world(), Dist::new_group(), Dist::side_group() and the groups of a DeviceMesh.
class Communicator {
 public:
  class Impl;  // the queue, its worker and the transport (src/comm/communicator.cpp)

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  // How the group's collectives travel: "shm" (shared memory, ranks of one host), "gloo",
  // "shm+gloo" (shared memory within hosts, Gloo between them), "nccl" or "local" (one rank).
  const char* backend_name() const;
  std::chrono::milliseconds timeout() const;
  int global_rank(int group_rank) const;

  // output: size() * input.numel() elements, contiguous; rank r's input lands in chunk r.
  CommHandle all_gather(at::Tensor output, at::Tensor input, const std::string& tag);
  // input: size() * output.numel() elements, contiguous; output gets the reduction of chunk rank().
  // The input is used as scratch space and holds unspecified values afterwards.
  CommHandle reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op, const std::string& tag);
  CommHandle all_reduce(at::Tensor tensor, ReduceOp op, const std::string& tag);
  CommHandle broadcast(at::Tensor tensor, int root, const std::string& tag);
  void barrier(const std::string& tag);
  // Checks that every rank ran the same collectives since the last check, and throws DistError
  // naming each rank's collective where they differ. The CPU transports check every collective as
  // it runs (its identity travels with its bytes), so this returns at once there; over NCCL it is
  // a small all-gather, run by the end of each backward before any optimizer step. Every rank must
  // call it at the same point.
  void verify_collectives(const std::string& tag);
  // Whether verify_collectives has work: this group's transport cannot carry identities (NCCL),
  // or FSDP_COLLECTIVE_IDS=queue.
  bool checks_ids_in_queue() const;

  CommStats stats() const;
  void reset_stats();
  // Records every collective (issue to completion) and every blocking wait on it from now on.
  void set_tracer(std::shared_ptr<Tracer> tracer);

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
