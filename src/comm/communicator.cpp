// Communicator: ordered asynchronous collectives with counters and bounded waits.
//
// Note [One ordered queue per communicator]
// Every collective on a communicator runs on that communicator's single worker thread (a
// base::WorkerQueue, Note [Worker queues]), in issue order. Ranks that issue the same sequence of
// collectives therefore run them in the same order, whatever thread issued them, and a collective
// can be issued (e.g. a prefetch or a gradient reduce-scatter) without blocking the caller. After
// a failure the communicator is broken: every later collective fails at once with the first
// error, so no rank runs on with a half-finished exchange.
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

#include <condition_variable>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "base/worker_queue.h"
#include "comm/communicator_impl.h"
#include "comm/id_check.h"
#include "comm/order_check.h"
#include "comm/transport.h"
#include "fsdp/trace.h"

namespace fsdp {
namespace {
using Clock = std::chrono::steady_clock;

// Adds a transport's byte counts to a collective's counters.
void count(OpStats& s, const TransferCount& c) {
  s.bytes_sent += c.sent;
  s.bytes_received += c.received;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

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

struct CommHandle::Pending {
  CollectiveKind kind;
  std::string description;  // "reduce_scatter 'layers.0' on rank 1 of 2 (group 'world')"
  std::chrono::milliseconds timeout;
  std::function<void(Transport&, OpStats&)> body;
  std::shared_ptr<StatsBox> stats;
  std::shared_ptr<Tracer> tracer;
  std::string tag;
  uint64_t bytes = 0;   // payload bytes of this rank's input (for the order check)
  int dtype = -1;       // at::ScalarType of the payload; -1 for none
  std::string lane;     // "comm <group>"
  bool verify = false;  // Communicator::verify_collectives: the queue's identity check, no payload
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

namespace {
using PendingCollective = CommHandle::Pending;
}  // namespace

// What a Communicator is: the transport, the ordered queue and its worker thread, the counters.
class Communicator::Impl {
 public:
  Impl(std::unique_ptr<Transport> transport, CommunicatorOptions options);
  ~Impl();
  static std::shared_ptr<Communicator> wrap(std::unique_ptr<Impl> impl) {
    return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
  }

  // Queues a collective (or, in a one-rank group, runs it now). `keep_alive` holds the tensors
  // until it has run; its last tensor is the input this rank contributes.
  std::shared_ptr<PendingCollective> enqueue(CollectiveKind kind, const std::string& tag,
                                             std::vector<at::Tensor> keep_alive,
                                             std::function<void(Transport&, OpStats&)> body);
  int global_rank(int group_rank) const { return options.global_ranks.at(group_rank); }
  void push(const std::shared_ptr<PendingCollective>& p);
  // Whether verify_collectives has work: the queue's identity check is on (set before the worker
  // starts, never changed).
  bool verifies() const { return queue_check.has_value(); }
  std::shared_ptr<PendingCollective> describe(CollectiveKind kind, const std::string& tag,
                                              const std::vector<at::Tensor>& keep_alive);

  std::unique_ptr<Transport> transport;
  CommunicatorOptions options;
  int rank;
  int size;

  // The ordered queue: one lane, its first error is the communicator's (every later collective
  // fails with it); stopping fails what is still queued. Its lock also guards `tracer`.
  base::WorkerQueue<std::shared_ptr<PendingCollective>> queue{
      [this](std::shared_ptr<PendingCollective>& p, const base::Turn& turn) { run_queued(*p, turn); }};
  std::shared_ptr<StatsBox> stats = std::make_shared<StatsBox>();
  std::shared_ptr<Tracer> tracer;

 private:
  void run_now(PendingCollective& p);
  void run_queued(PendingCollective& p, const base::Turn& turn);
  std::exception_ptr run(PendingCollective& p, int64_t seq, OpStats& delta);
  void run_on_device_stream(PendingCollective& p, OpStats& delta);
  std::exception_ptr failure(const PendingCollective& p);
  void add_stats(CollectiveKind kind, const OpStats& delta);

  int64_t next_seq = 0;                      // collectives run so far (worker thread only)
  std::optional<QueueIdCheck> queue_check;   // Note [Identity check in the queue] (worker only)
  std::optional<c10::Stream> device_stream;  // the worker's stream for device collectives
};

CommHandle::CommHandle(std::shared_ptr<Pending> pending) : pending_(std::move(pending)) {}

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

Communicator::Impl::Impl(std::unique_ptr<Transport> transport_in, CommunicatorOptions options_in)
    : transport(std::move(transport_in)),
      options(std::move(options_in)),
      rank(transport->rank()),
      size(transport->size()) {
  if (options.global_ranks.empty()) {
    for (int r = 0; r < size; ++r) options.global_ranks.push_back(r);
  }
  if (static_cast<int>(options.global_ranks.size()) != size) {
    throw ConfigError("fsdp: communicator '" + options.name + "' has " + std::to_string(size) + " ranks but " +
                      std::to_string(options.global_ranks.size()) + " global ranks");
  }
  const IdCheck ids = collective_id_check();
  if (size > 1 && (ids == IdCheck::kQueue || (ids == IdCheck::kAuto && !transport->carries_ids()))) {
    queue_check.emplace(rank, size, options.name, options.id_check_every);
  }
  if (size > 1) queue.start();
}

// The queue's thread stops once it has failed what is still queued (run_queued).
Communicator::Impl::~Impl() { queue.stop(base::OnStop::kDrain); }

// One collective on the worker thread. It must not run after the communicator's first error, nor
// once the communicator is being destroyed: it fails saying why.
void Communicator::Impl::run_queued(PendingCollective& p, const base::Turn& turn) {
  if (turn.first_error || turn.stopping) {
    const std::string broken = turn.first_error ? base::error_text(turn.first_error) : "the communicator was destroyed";
    p.finish(std::make_exception_ptr(DistError("fsdp: " + p.description + " not run: group '" + options.name +
                                               "' is unusable after an earlier failure: " + broken)));
    return;
  }
  if (p.verify) {
    std::exception_ptr error;
    try {
      if (queue_check) queue_check->check(*transport, next_seq);
    } catch (...) {
      error = failure(p);
      queue.keep_error(error);
    }
    p.finish(error);
    return;
  }
  OpStats delta;
  const auto t0 = Clock::now();
  const int64_t seq = next_seq++;
  std::exception_ptr error = run(p, seq, delta);
  delta.calls = 1;
  delta.busy_s = seconds_since(t0);
  if (p.tracer) p.tracer->span(std::string("fsdp::") + collective_name(p.kind), p.lane, p.issued, Clock::now(), p.tag);
  add_stats(p.kind, delta);
  if (error) queue.keep_error(error);
  p.finish(error);
}

// Runs one collective on the worker thread; returns its error, worded for the caller.
std::exception_ptr Communicator::Impl::run(PendingCollective& p, int64_t seq, OpStats& delta) {
  try {
    CollectiveId id;
    id.seq = static_cast<uint64_t>(seq);
    id.kind = static_cast<int>(p.kind);
    id.dtype = p.dtype;
    id.bytes = p.bytes;
    id.tag = p.tag;
    if (options.check_order) {
      CollectiveId exchange = id;
      exchange.kind = -1;
      exchange.dtype = -1;
      exchange.bytes = 0;
      exchange.tag = "collective-order check";
      transport->begin(exchange);
      OrderProbe probe;
      probe.seq = seq;
      probe.kind = p.kind;
      probe.bytes = p.bytes;
      probe.dtype = p.dtype;
      probe.tag = p.tag;
      probe.description = p.description;
      check_collective_order(*transport, options, rank, size, probe);
    }
    // Note [Identity check in the queue]: a full window is checked before this collective runs.
    if (queue_check && queue_check->record(id)) queue_check->check(*transport, id.seq);
    transport->begin(id);
    if (p.order) {
      run_on_device_stream(p, delta);
    } else {
      p.body(*transport, delta);
    }
  } catch (...) {
    return failure(p);
  }
  return nullptr;
}

// See Note [Collectives on the caller's stream].
void Communicator::Impl::run_on_device_stream(PendingCollective& p, OpStats& delta) {
  auto& stream = device_stream;
  const c10::Device& d = p.order->device;
  if (!stream || stream->device() != d) {
    stream = c10::impl::VirtualGuardImpl(d.type()).getStreamFromGlobalPool(d, /*isHighPriority=*/false);
  }
  p.order->issued.block(*stream);
  c10::StreamGuard on_worker_stream(*stream);
  p.body(*transport, delta);
  p.order->finished.record(*stream);
}

// The exception in flight, as the error the collective's callers see: it names the collective
// and, when known, the peer.
std::exception_ptr Communicator::Impl::failure(const PendingCollective& p) {
  try {
    throw;
  } catch (const CollectiveMismatch& e) {
    return std::make_exception_ptr(DistError("fsdp: " + p.description + " failed: " + e.what() + " (rank " +
                                             std::to_string(e.peer()) + " is global rank " +
                                             std::to_string(global_rank(e.peer())) + ")"));
  } catch (const PeerError& e) {
    const std::string text = "fsdp: " + p.description + " failed: peer rank " + std::to_string(e.peer()) +
                             " (global rank " + std::to_string(global_rank(e.peer())) + "): " + e.what();
    if (e.timed_out()) return std::make_exception_ptr(TimeoutError(text));
    return std::make_exception_ptr(DistError(text));
  } catch (const OrderMismatch& e) {
    return std::make_exception_ptr(DistError("fsdp: " + p.description + " failed: " + e.what()));
  } catch (const TimeoutError& e) {
    return std::make_exception_ptr(TimeoutError("fsdp: " + p.description + " failed: " + e.what()));
  } catch (const std::exception& e) {
    // Gloo's own collectives (all-reduce, broadcast, barrier) do not say which peer failed; in a
    // group of two it can only be the other rank.
    std::string peer;
    if (size == 2) {
      const int other = 1 - rank;
      peer = "peer rank " + std::to_string(other) + " (global rank " + std::to_string(global_rank(other)) +
             ", the group's only other rank): ";
    }
    return std::make_exception_ptr(DistError("fsdp: " + p.description + " failed: " + peer + e.what()));
  }
}

void Communicator::Impl::add_stats(CollectiveKind kind, const OpStats& delta) {
  std::lock_guard<std::mutex> lock(stats->mu);
  auto& s = stats->stats.ops[static_cast<int>(kind)];
  s.calls += delta.calls;
  s.bytes_sent += delta.bytes_sent;
  s.bytes_received += delta.bytes_received;
  s.busy_s += delta.busy_s;
}

std::shared_ptr<PendingCollective> Communicator::Impl::enqueue(CollectiveKind kind, const std::string& tag,
                                                               std::vector<at::Tensor> keep_alive,
                                                               std::function<void(Transport&, OpStats&)> body) {
  auto p = describe(kind, tag, keep_alive);
  if (size > 1 && !keep_alive.empty() && !keep_alive.front().device().is_cpu()) {
    // Note [Collectives on the caller's stream]
    const c10::Device d = keep_alive.front().device();
    p->order = std::make_shared<DeviceOrder>(d);
    p->order->issued.record(c10::impl::VirtualGuardImpl(d.type()).getStream(d));
  }
  // The tensors stay referenced until the collective has run: see Note [One ordered queue per communicator].
  p->body = [body = std::move(body), keep = std::move(keep_alive)](Transport& t, OpStats& s) { body(t, s); };
  if (size == 1) {
    run_now(*p);
    return p;
  }
  push(p);
  return p;
}

void Communicator::Impl::push(const std::shared_ptr<PendingCollective>& p) { queue.submit(p); }

// A new pending collective with everything but its body: names, counters, tracer.
std::shared_ptr<PendingCollective> Communicator::Impl::describe(CollectiveKind kind, const std::string& tag,
                                                                const std::vector<at::Tensor>& keep_alive) {
  auto p = std::make_shared<PendingCollective>();
  p->kind = kind;
  std::ostringstream desc;
  desc << collective_name(kind) << " '" << tag << "' on rank " << rank << " of " << size << " (group '" << options.name
       << "')";
  p->description = desc.str();
  p->timeout = options.timeout;
  p->stats = stats;
  p->tag = tag;
  if (!keep_alive.empty()) {
    // The last tensor is the input the rank contributes: see the callers.
    p->bytes = keep_alive.back().nbytes();
    p->dtype = static_cast<int>(keep_alive.back().scalar_type());
  }
  p->issued = Clock::now();
  {
    auto lock = queue.lock();
    p->tracer = tracer;
  }
  if (p->tracer) p->lane = "comm " + options.name;
  return p;
}

// World size 1: no thread, no queue; run on the caller's thread, now.
void Communicator::Impl::run_now(PendingCollective& p) {
  OpStats delta;
  const auto t0 = Clock::now();
  p.body(*transport, delta);
  OpStats counted;
  counted.calls = 1;
  counted.busy_s = seconds_since(t0);
  add_stats(p.kind, counted);
  p.done = true;
}

std::shared_ptr<Communicator> make_communicator(std::unique_ptr<Transport> transport, CommunicatorOptions options) {
  return Communicator::Impl::wrap(std::make_unique<Communicator::Impl>(std::move(transport), std::move(options)));
}

std::shared_ptr<Communicator> make_local_group(const std::string& name, int global_rank,
                                               std::chrono::milliseconds timeout) {
  CommunicatorOptions options;
  options.name = name;
  options.timeout = timeout;
  options.global_ranks = {global_rank};
  return make_communicator(make_local_transport(), std::move(options));
}

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Communicator::~Communicator() = default;

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
const std::string& Communicator::name() const { return impl_->options.name; }
const char* Communicator::backend_name() const { return impl_->transport->backend_name(); }
std::chrono::milliseconds Communicator::timeout() const { return impl_->options.timeout; }
int Communicator::global_rank(int group_rank) const { return impl_->global_rank(group_rank); }

CommHandle Communicator::all_gather(at::Tensor output, at::Tensor input, const std::string& tag) {
  const int size = impl_->size;
  check_flat(output, "output", "all_gather");
  check_flat(input, "input", "all_gather");
  if (output.numel() != input.numel() * size || output.scalar_type() != input.scalar_type()) {
    std::ostringstream msg;
    msg << "fsdp: all_gather '" << tag << "': output must hold size() * input.numel() = " << size << " * "
        << input.numel() << " elements of the input's dtype, got " << output.numel() << " of " << output.scalar_type()
        << " (input " << input.scalar_type() << ")";
    throw ConfigError(msg.str());
  }
  auto out = output.view(-1), in = input.view(-1);
  auto body = [out, in](Transport& t, OpStats& s) {
    TransferCount c;
    const OnTransport o(t, out), i(t, in);
    t.all_gather(o.there, i.there, c);
    o.back();
    count(s, c);
  };
  return CommHandle(impl_->enqueue(CollectiveKind::kAllGather, tag, {out, in}, body));
}

CommHandle Communicator::reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op, const std::string& tag) {
  const int size = impl_->size;
  check_flat(output, "output", "reduce_scatter");
  check_flat(input, "input", "reduce_scatter");
  if (input.numel() != output.numel() * size || output.scalar_type() != input.scalar_type()) {
    std::ostringstream msg;
    msg << "fsdp: reduce_scatter '" << tag << "': input must hold size() * output.numel() = " << size << " * "
        << output.numel() << " elements of the output's dtype, got " << input.numel() << " of " << input.scalar_type()
        << " (output " << output.scalar_type() << ")";
    throw ConfigError(msg.str());
  }
  auto out = output.view(-1), in = input.view(-1);
  auto body = [out, in, op](Transport& t, OpStats& s) {
    TransferCount c;
    const OnTransport o(t, out), i(t, in);
    t.reduce_scatter(o.there, i.there, op, c);
    o.back();
    count(s, c);
  };
  return CommHandle(impl_->enqueue(CollectiveKind::kReduceScatter, tag, {out, in}, body));
}

CommHandle Communicator::all_reduce(at::Tensor tensor, ReduceOp op, const std::string& tag) {
  check_flat(tensor, "tensor", "all_reduce");
  auto body = [tensor, op](Transport& t, OpStats& s) {
    TransferCount c;
    const OnTransport x(t, tensor);
    t.all_reduce(x.there, op, c);
    x.back();
    count(s, c);
  };
  return CommHandle(impl_->enqueue(CollectiveKind::kAllReduce, tag, {tensor}, body));
}

CommHandle Communicator::broadcast(at::Tensor tensor, int root, const std::string& tag) {
  check_flat(tensor, "tensor", "broadcast");
  if (root < 0 || root >= impl_->size) {
    throw ConfigError("fsdp: broadcast '" + tag + "': root " + std::to_string(root) + " is not a rank of group '" +
                      impl_->options.name + "' (size " + std::to_string(impl_->size) + ")");
  }
  auto body = [tensor, root](Transport& t, OpStats& s) {
    TransferCount c;
    const OnTransport x(t, tensor);
    t.broadcast(x.there, root, c);
    x.back();
    count(s, c);
  };
  return CommHandle(impl_->enqueue(CollectiveKind::kBroadcast, tag, {tensor}, body));
}

bool Communicator::checks_ids_in_queue() const { return impl_->verifies(); }

void Communicator::verify_collectives(const std::string& tag) {
  // Queued like a collective, so it lands at the same place in every rank's sequence; a
  // transport that carries identities has checked each collective already.
  if (!impl_->verifies()) return;
  auto p = impl_->describe(CollectiveKind::kAllGather, tag, {});
  p->verify = true;
  p->description = "collective identity check '" + tag + "' on rank " + std::to_string(impl_->rank) + " of " +
                   std::to_string(impl_->size) + " (group '" + impl_->options.name + "')";
  impl_->push(p);
  CommHandle(p).wait();
}

void Communicator::barrier(const std::string& tag) {
  auto body = [](Transport& t, OpStats&) {
    TransferCount c;
    t.barrier(c);
  };
  CommHandle(impl_->enqueue(CollectiveKind::kBarrier, tag, {}, body)).wait();
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats->mu);
  return impl_->stats->stats;
}

void Communicator::set_tracer(std::shared_ptr<Tracer> tracer) {
  auto lock = impl_->queue.lock();
  impl_->tracer = std::move(tracer);
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lock(impl_->stats->mu);
  impl_->stats->stats = CommStats{};
}

}  // namespace fsdp
