// Communicator: the one place all fsdp communication goes through. Every collective is issued
// asynchronously onto the communicator's own ordered queue (so the order is the same on every
// rank by construction), is counted (bytes sent and received, time busy, time callers blocked),
// and every wait is bounded by a timeout whose error names the collective, the caller's tag and,
// when known, the peer.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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
class Transport;
struct PendingCollective;

// A handle on an issued collective; wait() blocks until it finishes (or throws its error).
// Waiting twice is a no-op. Dropping a handle without waiting is allowed: the collective still
// runs, and its error, if any, surfaces at the next collective on the same communicator.
class CommHandle {
 public:
  CommHandle() = default;
  explicit CommHandle(std::shared_ptr<PendingCollective> pending) : pending_(std::move(pending)) {}
  void wait();
  bool is_completed() const;
  bool valid() const { return pending_ != nullptr; }

 private:
  std::shared_ptr<PendingCollective> pending_;
};

struct CommunicatorOptions {
  std::string name = "world";  // shows in errors: "group 'world'"
  std::chrono::milliseconds timeout{60000};
  std::vector<int> global_ranks;  // the group's members by global rank; empty = 0..size-1
  // Debug: before every collective the ranks exchange a fingerprint (sequence number, kind, tag,
  // bytes) and fail with a mismatch naming the ranks, ops and tags instead of hanging or mixing
  // data. See Note [Collective-order check] in src/comm/communicator.cpp.
  bool check_order = false;
  // With check_order: a board shared by the ranks (the rendezvous store) where each rank posts the
  // collective it has reached, so a rank that skipped one can be named when the fingerprint
  // exchange times out. Both may be empty.
  std::function<void(const std::string& key, const std::string& value)> order_post;
  std::function<std::optional<std::string>(const std::string& key)> order_lookup;
};

class Communicator {
 public:
  Communicator(std::unique_ptr<Transport> transport, CommunicatorOptions options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  int global_rank(int group_rank) const;

  // output: size() * input.numel() elements, contiguous; rank r's input lands in chunk r.
  CommHandle all_gather(at::Tensor output, at::Tensor input, const std::string& tag);
  // input: size() * output.numel() elements, contiguous; output gets the reduction of chunk rank().
  // The input is used as scratch space and holds unspecified values afterwards.
  CommHandle reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op, const std::string& tag);
  CommHandle all_reduce(at::Tensor tensor, ReduceOp op, const std::string& tag);
  CommHandle broadcast(at::Tensor tensor, int root, const std::string& tag);
  void barrier(const std::string& tag);

  CommStats stats() const;
  void reset_stats();
  // Records every collective (issue to completion) and every blocking wait on it from now on.
  void set_tracer(std::shared_ptr<Tracer> tracer);

 private:
  CommHandle enqueue(CollectiveKind kind, const std::string& tag,
                     std::vector<at::Tensor> keep_alive,
                     std::function<void(Transport&, OpStats&)> body);
  void worker_loop();
  void check_order(Transport& transport, const PendingCollective& p, int64_t seq);

  struct State;
  std::unique_ptr<State> state_;
  std::unique_ptr<Transport> transport_;
  CommunicatorOptions options_;
  int rank_;
  int size_;
};

}  // namespace fsdp
