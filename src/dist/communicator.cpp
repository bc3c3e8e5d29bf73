// Communicator: ordered asynchronous collectives with counters and bounded waits.
//
// Note [One ordered queue per communicator]
// Every collective on a communicator runs on that communicator's single worker thread, in issue
// order. Ranks that issue the same sequence of collectives therefore run them in the same order,
// whatever thread issued them, and a collective can be issued (e.g. a prefetch or a gradient
// reduce-scatter) without blocking the caller. After a failure the communicator is broken: every
// later collective fails at once with the first error, so no rank runs on with a half-finished
// exchange.
#include "fsdp/comm.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

#include "dist/transport.h"
#include "fsdp/trace.h"

namespace fsdp {
namespace {
using Clock = std::chrono::steady_clock;

// Adds a transport's byte counts to a collective's counters.
void count(OpStats& s, const TransferCount& c) {
  s.bytes_sent += c.sent;
  s.bytes_received += c.received;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check_flat(const at::Tensor& t, const char* what, const char* op) {
  if (!t.defined() || !t.is_contiguous()) {
    throw ConfigError(std::string("fsdp: ") + op + ": " + what + " must be a defined, contiguous tensor");
  }
}
}  // namespace

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "unknown";
}

uint64_t CommStats::total_bytes_sent() const {
  uint64_t total = 0;
  for (const auto& op : ops) total += op.bytes_sent;
  return total;
}

double CommStats::total_wait_s() const {
  double total = 0;
  for (const auto& op : ops) total += op.wait_s;
  return total;
}

CommStats CommStats::operator-(const CommStats& earlier) const {
  CommStats d;
  for (int i = 0; i < kNumCollectiveKinds; ++i) {
    d.ops[i].calls = ops[i].calls - earlier.ops[i].calls;
    d.ops[i].bytes_sent = ops[i].bytes_sent - earlier.ops[i].bytes_sent;
    d.ops[i].bytes_received = ops[i].bytes_received - earlier.ops[i].bytes_received;
    d.ops[i].busy_s = ops[i].busy_s - earlier.ops[i].busy_s;
    d.ops[i].wait_s = ops[i].wait_s - earlier.ops[i].wait_s;
  }
  return d;
}

// Counters shared by the communicator and its outstanding handles.
struct StatsBox {
  std::mutex mu;
  CommStats stats;
};

struct PendingCollective {
  CollectiveKind kind;
  std::string description;  // "reduce_scatter 'layers.0' on rank 1 of 2 (group 'world')"
  std::chrono::milliseconds timeout;
  std::function<void(Transport&, OpStats&)> body;
  std::shared_ptr<StatsBox> stats;
  std::shared_ptr<Tracer> tracer;
  std::string tag;
  std::string lane;  // "comm <group>"
  Clock::time_point issued;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

struct Communicator::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<PendingCollective>> queue;
  bool stopping = false;
  std::string first_error;  // non-empty once broken
  std::shared_ptr<StatsBox> stats = std::make_shared<StatsBox>();
  std::shared_ptr<Tracer> tracer;
  std::thread worker;
};

void CommHandle::wait() {
  if (!pending_) return;
  auto& p = *pending_;
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(p.mu);
  // The transport bounds each transfer by the timeout; the slack covers the queue ahead of us.
  const auto limit = p.timeout * 2 + std::chrono::seconds(5);
  const bool already = p.done;
  const bool finished = p.cv.wait_for(lock, limit, [&] { return p.done; });
  lock.unlock();
  {
    std::lock_guard<std::mutex> slock(p.stats->mu);
    p.stats->stats.ops[static_cast<int>(p.kind)].wait_s += seconds_since(t0);
  }
  if (p.tracer && !already) {
    p.tracer->span(std::string("fsdp::") + collective_name(p.kind) + "_wait", "compute", t0, Clock::now(), p.tag);
  }
  if (!finished) {
    throw TimeoutError("fsdp: " + p.description + " did not finish within " +
                       std::to_string(std::chrono::duration<double>(limit).count()) +
                       " s (a peer may be stopped or dead)");
  }
  if (p.error) std::rethrow_exception(p.error);
}

bool CommHandle::is_completed() const {
  if (!pending_) return true;
  std::lock_guard<std::mutex> lock(pending_->mu);
  return pending_->done;
}

Communicator::Communicator(std::unique_ptr<Transport> transport, CommunicatorOptions options)
    : state_(std::make_unique<State>()),
      transport_(std::move(transport)),
      options_(std::move(options)),
      rank_(transport_->rank()),
      size_(transport_->size()) {
  if (options_.global_ranks.empty()) {
    for (int r = 0; r < size_; ++r) options_.global_ranks.push_back(r);
  }
  if (static_cast<int>(options_.global_ranks.size()) != size_) {
    throw ConfigError("fsdp: communicator '" + options_.name + "' has " + std::to_string(size_) +
                      " ranks but " + std::to_string(options_.global_ranks.size()) + " global ranks");
  }
  if (size_ > 1) state_->worker = std::thread([this] { worker_loop(); });
}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
}

int Communicator::global_rank(int group_rank) const { return options_.global_ranks.at(group_rank); }

void Communicator::worker_loop() {
  for (;;) {
    std::shared_ptr<PendingCollective> p;
    std::string broken;
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      state_->cv.wait(lock, [&] { return state_->stopping || !state_->queue.empty(); });
      if (state_->queue.empty()) return;
      p = state_->queue.front();
      state_->queue.pop_front();
      broken = state_->first_error;
      if (state_->stopping && broken.empty()) broken = "the communicator was destroyed";
    }
    if (!broken.empty()) {
      p->finish(std::make_exception_ptr(
          DistError("fsdp: " + p->description + " not run: group '" + options_.name +
                    "' is unusable after an earlier failure: " + broken)));
      continue;
    }
    OpStats delta;
    const auto t0 = Clock::now();
    std::exception_ptr error;
    try {
      p->body(*transport_, delta);
    } catch (const PeerError& e) {
      error = std::make_exception_ptr(DistError(
          "fsdp: " + p->description + " failed: peer rank " + std::to_string(e.peer()) +
          " (global rank " + std::to_string(global_rank(e.peer())) + "): " + e.what()));
    } catch (const TimeoutError& e) {
      error = std::make_exception_ptr(TimeoutError("fsdp: " + p->description + " failed: " + e.what()));
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(DistError("fsdp: " + p->description + " failed: " + e.what()));
    }
    delta.calls = 1;
    delta.busy_s = seconds_since(t0);
    if (p->tracer) p->tracer->span(std::string("fsdp::") + collective_name(p->kind), p->lane, p->issued, Clock::now(), p->tag);
    {
      std::lock_guard<std::mutex> lock(state_->stats->mu);
      auto& s = state_->stats->stats.ops[static_cast<int>(p->kind)];
      s.calls += delta.calls;
      s.bytes_sent += delta.bytes_sent;
      s.bytes_received += delta.bytes_received;
      s.busy_s += delta.busy_s;
    }
    if (error) {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->first_error.empty()) {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          state_->first_error = e.what();
        }
      }
    }
    p->finish(error);
  }
}

CommHandle Communicator::enqueue(CollectiveKind kind, const std::string& tag,
                                 std::vector<at::Tensor> keep_alive,
                                 std::function<void(Transport&, OpStats&)> body) {
  auto p = std::make_shared<PendingCollective>();
  p->kind = kind;
  std::ostringstream desc;
  desc << collective_name(kind) << " '" << tag << "' on rank " << rank_ << " of " << size_
       << " (group '" << options_.name << "')";
  p->description = desc.str();
  p->timeout = options_.timeout;
  p->stats = state_->stats;
  p->tag = tag;
  p->issued = Clock::now();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    p->tracer = state_->tracer;
  }
  if (p->tracer) p->lane = "comm " + options_.name;
  // The tensors stay referenced until the collective has run: see Note [One ordered queue].
  p->body = [body = std::move(body), keep = std::move(keep_alive)](Transport& t, OpStats& s) {
    body(t, s);
  };
  if (size_ == 1) {
    // World size 1: no thread, no queue; run now.
    OpStats delta;
    const auto t0 = Clock::now();
    p->body(*transport_, delta);
    std::lock_guard<std::mutex> lock(state_->stats->mu);
    auto& s = state_->stats->stats.ops[static_cast<int>(kind)];
    s.calls += 1;
    s.busy_s += seconds_since(t0);
    p->done = true;
    return CommHandle(p);
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(p);
  }
  state_->cv.notify_all();
  return CommHandle(p);
}

CommHandle Communicator::all_gather(at::Tensor output, at::Tensor input, const std::string& tag) {
  check_flat(output, "output", "all_gather");
  check_flat(input, "input", "all_gather");
  if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type()) {
    std::ostringstream msg;
    msg << "fsdp: all_gather '" << tag << "': output must hold size() * input.numel() = " << size_
        << " * " << input.numel() << " elements of the input's dtype, got " << output.numel() << " of "
        << output.scalar_type() << " (input " << input.scalar_type() << ")";
    throw ConfigError(msg.str());
  }
  auto out = output.view(-1), in = input.view(-1);
  return enqueue(CollectiveKind::kAllGather, tag, {out, in}, [out, in](Transport& t, OpStats& s) {
    TransferCount c;
    t.all_gather(out, in, c);
    count(s, c);
  });
}

CommHandle Communicator::reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                                        const std::string& tag) {
  check_flat(output, "output", "reduce_scatter");
  check_flat(input, "input", "reduce_scatter");
  if (input.numel() != output.numel() * size_ || output.scalar_type() != input.scalar_type()) {
    std::ostringstream msg;
    msg << "fsdp: reduce_scatter '" << tag << "': input must hold size() * output.numel() = " << size_
        << " * " << output.numel() << " elements of the output's dtype, got " << input.numel() << " of "
        << input.scalar_type() << " (output " << output.scalar_type() << ")";
    throw ConfigError(msg.str());
  }
  auto out = output.view(-1), in = input.view(-1);
  return enqueue(CollectiveKind::kReduceScatter, tag, {out, in},
                 [out, in, op](Transport& t, OpStats& s) {
                   TransferCount c;
                   t.reduce_scatter(out, in, op, c);
                   count(s, c);
                 });
}

CommHandle Communicator::all_reduce(at::Tensor tensor, ReduceOp op, const std::string& tag) {
  check_flat(tensor, "tensor", "all_reduce");
  return enqueue(CollectiveKind::kAllReduce, tag, {tensor}, [tensor, op](Transport& t, OpStats& s) {
    TransferCount c;
    t.all_reduce(tensor, op, c);
    count(s, c);
  });
}

CommHandle Communicator::broadcast(at::Tensor tensor, int root, const std::string& tag) {
  check_flat(tensor, "tensor", "broadcast");
  if (root < 0 || root >= size_) {
    throw ConfigError("fsdp: broadcast '" + tag + "': root " + std::to_string(root) +
                      " is not a rank of group '" + options_.name + "' (size " + std::to_string(size_) + ")");
  }
  return enqueue(CollectiveKind::kBroadcast, tag, {tensor}, [tensor, root](Transport& t, OpStats& s) {
    TransferCount c;
    t.broadcast(tensor, root, c);
    count(s, c);
  });
}

void Communicator::barrier(const std::string& tag) {
  enqueue(CollectiveKind::kBarrier, tag, {}, [](Transport& t, OpStats&) {
    TransferCount c;
    t.barrier(c);
  }).wait();
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(state_->stats->mu);
  return state_->stats->stats;
}

void Communicator::set_tracer(std::shared_ptr<Tracer> tracer) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->tracer = std::move(tracer);
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lock(state_->stats->mu);
  state_->stats->stats = CommStats{};
}

}  // namespace fsdp
