// Communicator: ordered asynchronous collectives with counters and bounded waits.
//
// Note [One ordered queue per communicator]
// Every collective on a communicator runs on that communicator's single worker thread, in issue
// order. Ranks that issue the same sequence of collectives therefore run them in the same order,
// whatever thread issued them, and a collective can be issued (e.g. a prefetch or a gradient
// reduce-scatter) without blocking the caller. After a failure the communicator is broken: every
// later collective fails at once with the first error, so no rank runs on with a half-finished
// exchange.
//
// Note [Collective-order check]
// Ranks must issue collectives in the same order; a rank that skips or reorders one either hangs
// its peers or, worse, pairs its bytes with another collective's and corrupts data silently. With
// CommunicatorOptions::check_order (InitOptions::check_collectives, FSDP_CHECK_COLLECTIVES=1) the
// worker first all-gathers a fixed-size fingerprint of the collective it is about to run: its
// sequence number on this communicator, kind, payload bytes, dtype and tag (the unit). Fingerprints
// are the same size whatever the collective, so the exchange itself always pairs up, and a
// mismatch fails on every rank before any payload moves, naming each rank's op and tag. A rank
// that skipped the last collective leaves the others waiting in the exchange until the timeout;
// each rank also posts "seq + description" to the store before exchanging, so that error names the
// ranks that never reached the sequence number and where they are. It is a debug option: one small
// all-gather and one store write per collective (figures in docs/NOTES.md), not counted in stats.
#include "fsdp/comm.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "comm/transport.h"
#include "fsdp/trace.h"

namespace fsdp {
namespace {
using Clock = std::chrono::steady_clock;

// Ranks disagree on the collective: no peer failed, so none is blamed.
class OrderMismatch : public DistError {
 public:
  using DistError::DistError;
};

// Adds a transport's byte counts to a collective's counters.
void count(OpStats& s, const TransferCount& c) {
  s.bytes_sent += c.sent;
  s.bytes_received += c.received;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Host tensors given to a device transport (the small control-plane collectives: save flags,
// clipping norms, metrics) travel through a device copy made on the worker; other tensors go as
// they are. back() copies a moved output home.
struct OnTransport {
  at::Tensor home, there;
  OnTransport(const Transport& t, const at::Tensor& x)
      : home(x), there(x.is_cpu() && !t.device().is_cpu() ? x.to(t.device()) : x) {}
  void back() const {
    if (!there.is_same(home)) home.copy_(there);
  }
};

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

// Note [Collectives on the caller's stream]
// On a device, a collective must start after the kernels its issuing thread queued before it (the
// ones that produced its input) but not wait for those queued since: a prefetched all-gather is
// meant to run beside the compute issued after it. So enqueue records `issued` on the issuer's
// current stream; the worker runs the collective with a stream of its own made current (the
// process group orders its NCCL stream after the current one), which first waits on `issued`.
// Afterwards it records `finished` there, and CommHandle::wait makes the waiting thread's
// current stream wait on it, so what that stream runs next (including the reuse of a freed
// buffer by the caching allocator) is ordered after the collective. The events and streams are
// device-generic (c10::Event, VirtualGuardImpl): no CUDA header here.
struct DeviceOrder {
  explicit DeviceOrder(const c10::Device& d) : device(d), issued(d.type()), finished(d.type()) {}
  c10::Device device;
  c10::Event issued;
  c10::Event finished;
};

struct PendingCollective {
  CollectiveKind kind;
  std::string description;  // "reduce_scatter 'layers.0' on rank 1 of 2 (group 'world')"
  std::chrono::milliseconds timeout;
  std::function<void(Transport&, OpStats&)> body;
  std::shared_ptr<StatsBox> stats;
  std::shared_ptr<Tracer> tracer;
  std::string tag;
  uint64_t bytes = 0;  // payload bytes of this rank's input (for the order check)
  int dtype = -1;      // at::ScalarType of the payload; -1 for none
  std::string lane;  // "comm <group>"
  Clock::time_point issued;
  std::shared_ptr<DeviceOrder> order;  // device collectives on a worker thread only

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
  int64_t next_seq = 0;  // collectives run so far (worker thread only)
  std::optional<c10::Stream> device_stream;  // the worker's stream for device collectives
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
  if (p.order) {  // Note [Collectives on the caller's stream]
    const c10::Device& d = p.order->device;
    p.order->finished.block(c10::impl::VirtualGuardImpl(d.type()).getStream(d));
  }
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
    const int64_t seq = state_->next_seq++;
    try {
      if (options_.check_order) check_order(*transport_, *p, seq);
      if (p->order) {  // Note [Collectives on the caller's stream]
        auto& stream = state_->device_stream;
        const c10::Device& d = p->order->device;
        if (!stream || stream->device() != d) {
          stream = c10::impl::VirtualGuardImpl(d.type()).getStreamFromGlobalPool(d, /*isHighPriority=*/false);
        }
        p->order->issued.block(*stream);
        c10::StreamGuard on_worker_stream(*stream);
        p->body(*transport_, delta);
        p->order->finished.record(*stream);
      } else {
        p->body(*transport_, delta);
      }
    } catch (const PeerError& e) {
      error = std::make_exception_ptr(DistError(
          "fsdp: " + p->description + " failed: peer rank " + std::to_string(e.peer()) +
          " (global rank " + std::to_string(global_rank(e.peer())) + "): " + e.what()));
    } catch (const OrderMismatch& e) {
      error = std::make_exception_ptr(DistError("fsdp: " + p->description + " failed: " + e.what()));
    } catch (const TimeoutError& e) {
      error = std::make_exception_ptr(TimeoutError("fsdp: " + p->description + " failed: " + e.what()));
    } catch (const std::exception& e) {
      // Gloo's own collectives (all-reduce, broadcast, barrier) do not say which peer failed; in a
      // group of two it can only be the other rank.
      std::string peer;
      if (size_ == 2) {
        const int other = 1 - rank_;
        peer = "peer rank " + std::to_string(other) + " (global rank " + std::to_string(global_rank(other)) +
               ", the group's only other rank): ";
      }
      error = std::make_exception_ptr(DistError("fsdp: " + p->description + " failed: " + peer + e.what()));
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

namespace {
// Fingerprint words: seq, kind, bytes, dtype, tag length, then the tag's bytes (truncated).
constexpr int64_t kFingerprintWords = 40;
constexpr int64_t kFingerprintHead = 5;
constexpr size_t kFingerprintTagBytes = (kFingerprintWords - kFingerprintHead) * sizeof(int64_t);

struct Fingerprint {
  int64_t seq = 0, kind = 0, bytes = 0, dtype = -1;
  std::string tag;
  bool operator==(const Fingerprint& o) const {
    return seq == o.seq && kind == o.kind && bytes == o.bytes && dtype == o.dtype && tag == o.tag;
  }
  std::string describe() const {
    std::ostringstream s;
    s << collective_name(static_cast<CollectiveKind>(kind)) << " '" << tag << "' (" << bytes << " bytes";
    if (dtype >= 0) s << " of " << c10::toString(static_cast<at::ScalarType>(dtype));
    s << ") as collective #" << seq;
    return s.str();
  }
};

at::Tensor encode(const Fingerprint& f) {
  auto t = at::zeros({kFingerprintWords}, at::kLong);
  auto* w = t.data_ptr<int64_t>();
  w[0] = f.seq, w[1] = f.kind, w[2] = f.bytes, w[3] = f.dtype;
  const size_t n = std::min(f.tag.size(), kFingerprintTagBytes);
  w[4] = static_cast<int64_t>(n);
  std::memcpy(w + kFingerprintHead, f.tag.data(), n);
  return t;
}

Fingerprint decode(const int64_t* w) {
  Fingerprint f;
  f.seq = w[0], f.kind = w[1], f.bytes = w[2], f.dtype = w[3];
  const size_t n = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(w[4], 0)), kFingerprintTagBytes);
  f.tag.assign(reinterpret_cast<const char*>(w + kFingerprintHead), n);
  if (f.kind < 0 || f.kind >= kNumCollectiveKinds) f.kind = 0;
  return f;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() > 1 ? "ranks " : "rank ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}
}  // namespace

// See Note [Collective-order check].
void Communicator::check_order(Transport& transport, const PendingCollective& p, int64_t seq) {
  Fingerprint mine;
  mine.seq = seq;
  mine.kind = static_cast<int64_t>(p.kind);
  mine.bytes = static_cast<int64_t>(p.bytes);
  mine.dtype = p.dtype;
  mine.tag = p.tag;
  const std::string key_prefix = "fsdp/order/" + options_.name + "/";
  if (options_.order_post) options_.order_post(key_prefix + std::to_string(rank_), std::to_string(seq) + "\t" + p.description);
  // The fingerprints travel where the transport moves data (device memory for NCCL).
  const c10::Device device = transport.device();
  auto all = at::empty({size_ * kFingerprintWords}, at::TensorOptions().dtype(at::kLong).device(device));
  TransferCount ignored;
  try {
    transport.all_gather(all, encode(mine).to(device), ignored);
  } catch (const std::exception& e) {
    // Who never got here? Ask the store where every rank is.
    std::ostringstream msg;
    msg << "collective-order check: " << p.description << " as collective #" << seq
        << " was not matched by every rank within " << std::chrono::duration<double>(options_.timeout).count()
        << " s";
    if (options_.order_lookup) {
      try {
        std::vector<int> behind;
        std::ostringstream where;
        for (int r = 0; r < size_; ++r) {
          if (r == rank_) continue;
          const std::string key = key_prefix + std::to_string(r);
          const auto posted = options_.order_lookup(key);
          if (!posted) {
            behind.push_back(r);
            where << "; rank " << r << " has run no collective on group '" << options_.name << "'";
            continue;
          }
          const std::string& v = *posted;
          const auto tab = v.find('\t');
          const int64_t their = std::stoll(v.substr(0, tab));
          if (their < seq) {
            behind.push_back(r);
            where << "; rank " << r << " is at collective #" << their << ": "
                  << (tab == std::string::npos ? "" : v.substr(tab + 1));
          }
        }
        if (!behind.empty()) msg << ": " << rank_list(behind) << " never reached collective #" << seq << where.str();
      } catch (const std::exception& se) {
        msg << " (the store could not say which rank is behind: " << se.what() << ")";
      }
    }
    msg << ": " << e.what();
    throw TimeoutError(msg.str());
  }
  all = all.cpu();
  const auto* w = all.data_ptr<int64_t>();
  std::vector<Fingerprint> prints;
  bool same = true;
  for (int r = 0; r < size_; ++r) {
    prints.push_back(decode(w + r * kFingerprintWords));
    same = same && prints.back() == mine;
  }
  if (same) return;
  // Group the ranks by what they issued, in rank order of first appearance.
  std::vector<std::pair<Fingerprint, std::vector<int>>> groups;
  for (int r = 0; r < size_; ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == prints[r]; });
    if (it == groups.end()) {
      groups.push_back({prints[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream msg;
  msg << "collective-order mismatch on group '" << options_.name << "' at collective #" << seq << ": ";
  for (size_t i = 0; i < groups.size(); ++i) {
    msg << (i ? "; " : "") << rank_list(groups[i].second) << " issued " << groups[i].first.describe();
  }
  msg << " (every rank must issue the same collectives in the same order)";
  throw OrderMismatch(msg.str());
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
  if (!keep_alive.empty()) {
    // The last tensor is the input the rank contributes: see the callers.
    p->bytes = keep_alive.back().nbytes();
    p->dtype = static_cast<int>(keep_alive.back().scalar_type());
  }
  p->issued = Clock::now();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    p->tracer = state_->tracer;
  }
  if (p->tracer) p->lane = "comm " + options_.name;
  if (size_ > 1 && !keep_alive.empty() && !keep_alive.front().device().is_cpu()) {
    // Note [Collectives on the caller's stream]
    const c10::Device d = keep_alive.front().device();
    p->order = std::make_shared<DeviceOrder>(d);
    p->order->issued.record(c10::impl::VirtualGuardImpl(d.type()).getStream(d));
  }
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
    const OnTransport o(t, out), i(t, in);
    t.all_gather(o.there, i.there, c);
    o.back();
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
                   const OnTransport o(t, out), i(t, in);
                   t.reduce_scatter(o.there, i.there, op, c);
                   o.back();
                   count(s, c);
                 });
}

CommHandle Communicator::all_reduce(at::Tensor tensor, ReduceOp op, const std::string& tag) {
  check_flat(tensor, "tensor", "all_reduce");
  return enqueue(CollectiveKind::kAllReduce, tag, {tensor}, [tensor, op](Transport& t, OpStats& s) {
    TransferCount c;
    const OnTransport x(t, tensor);
    t.all_reduce(x.there, op, c);
    x.back();
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
    const OnTransport x(t, tensor);
    t.broadcast(x.there, root, c);
    x.back();
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
