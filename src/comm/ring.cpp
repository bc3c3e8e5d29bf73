// RingTransport: CPU collectives as rings whose hops are Gloo point-to-point send/recv or, between
// ranks of one host, shared-memory channels (shm_channel.h).
//
// LibTorch's Gloo backend implements reduce_scatter_tensor as a full all-reduce plus a copy, which
// moves about 2(N-1)/N of the buffer per rank instead of (N-1)/N; its all-gather into a flat tensor
// goes through an extra staging copy. Rings over send/recv move exactly (N-1)/N of the buffer per
// rank and write straight into the caller's chunks. See Note [Ring schedule]. Every collective runs
// the same schedule whatever its hops are made of, so results are bitwise the same over Gloo and
// over shared memory (Note [One schedule, any hop]).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "comm/ring.h"
#include "comm/transport.h"

namespace fsdp {
namespace {

// Note [Ring schedule]
// Ranks form a ring r -> r+1. The buffer is cut into N equal chunks.
// reduce-scatter: at step s (0..N-2) rank r sends its partial sum of chunk (r-s-1) mod N to r+1 and
// receives r-1's partial sum of chunk (r-s-2) mod N, which it adds into its own copy. The chunk sent
// at step s is the one received and accumulated at step s-1, so after N-1 steps rank r holds the
// full sum of chunk r. all-gather: at step s rank r forwards chunk (r-s) mod N and receives chunk
// (r-s-1) mod N. Each step moves one chunk each way: (N-1)/N of the buffer per rank in total.
// Reduce-scatter sends each chunk in segments, so the add of one segment overlaps the transfer of
// the next.
int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

constexpr int64_t kSegmentBytes = 1 << 20;

std::string describe(const std::exception& e) {
  std::string s = e.what();
  // c10::Error appends a long backtrace; keep the first line.
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// Gloo reports a wait past its timeout as an exception whose text says so.
bool says_timed_out(const std::string& text) {
  return text.find("Timed out") != std::string::npos || text.find("timed out") != std::string::npos;
}

// Note [Collective identity in the framing]
// Ranks that issue different collectives (a rank skipped or repeated a backward) would otherwise
// pair their bytes whatever the op and size: an 80-byte reduce-scatter on one rank meeting a
// 384-byte all-gather on the other, the replicas diverging silently, or Gloo enforcing a size on
// its own thread and aborting the process. So every collective's identity (CollectiveId: sequence
// number, kind, dtype, payload bytes, tag) travels with its messages and is checked before a byte
// of them is used:
// - a shared-memory hop carries it in each slot (ShmChannel's `ids`), beside the slot's byte
//   count; the receiver compares both with its own before it copies or adds;
// - a Gloo hop gets one 128-byte message per collective, sent to the next rank and, in a ring of
//   more than two, to the previous one too, so both neighbours of a rank that went astray see
//   it. Its size never varies, so it always pairs. The data is posted beside it (a round trip of
//   its own per collective cost 39% of the communication-bound step), but under tags that carry
//   a digest of the identity, so a mismatched peer's data never matches this rank's receives and
//   a message of the wrong size never reaches Gloo; every wait on data comes after the identities
//   are compared. Gloo's own broadcast and barrier wait for the comparison first.
// A mismatch throws CollectiveMismatch naming both sides; the rank then closes its shared-memory
// hops with that text as the reason, so ranks further round the ring fail at once and say why.
// The cost is a 128-byte copy per slot and, over Gloo, one small exchange per collective
// (bench/results/compare.md). FSDP_COLLECTIVE_IDS=0 turns it off, for measuring that cost.
// A transport that cannot carry them (NCCL) is checked in the communicator's queue instead: Note
// [Identity check in the queue] in communicator.cpp.

// Note [One schedule, any hop]
// All four collectives are rings over the same two hops (to rank+1, from rank-1), whatever carries
// them: reduce-scatter and all-gather as in Note [Ring schedule], all-reduce as a reduce-scatter
// then an all-gather of the tensor padded to a multiple of the group size, broadcast as a pipeline
// from the root around the ring. Each element is therefore summed in the same order with the same
// operations over Gloo and over shared memory, and the results are bitwise equal. A Gloo-only group
// keeps Gloo's own broadcast and barrier (no arithmetic) and sends reduce-scatter chunks in
// segments so the add of one overlaps the transfer of the next; a group with both kinds of hop
// (several hosts, several ranks on some) sends one Gloo message per ring step, tagged by a step
// counter that every rank advances alike.
class RingTransport final : public Transport {
 public:
  RingTransport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const CpuTransportOptions& options,
                RingHops hops)
      : rank_(rank), size_(size), timeout_(options.timeout), hops_(std::move(hops)) {
    if (hops_.layout != RingHops::Layout::kShm) {
      disable_flight_recorder_once();
      auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
      opts->threads = options.threads;
      opts->devices.push_back(make_device(options.hostname));
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override {
    switch (hops_.layout) {
      case RingHops::Layout::kShm: return "shm";
      case RingHops::Layout::kMixed: return "shm+gloo";
      default: return "gloo";
    }
  }

  void all_gather(const at::Tensor& output, const at::Tensor& input, TransferCount& count) override {
    guarded([&] {
      post_ids();
      const int64_t n = input.numel();
      auto mine = output.narrow(0, rank_ * n, n);
      if (mine.data_ptr() != input.data_ptr()) mine.copy_(input.view(-1));
      ring_gather(output, n, count);
    });
  }

  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, TransferCount& count) override {
    guarded([&] {
      post_ids();
      const int64_t n = output.numel();
      ring_reduce(input, n, count);
      output.copy_(input.narrow(0, rank_ * n, n));
      if (op == ReduceOp::kAvg) output.div_(size_);
    });
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op, TransferCount& count) override {
    guarded([&] {
      post_ids();
      const int64_t numel = tensor.numel();
      const int64_t n = (numel + size_ - 1) / size_;
      const bool direct = tensor.is_contiguous() && n * size_ == numel;
      at::Tensor buf = direct ? tensor.view(-1) : at::zeros({n * size_}, tensor.options());
      if (!direct) buf.narrow(0, 0, numel).copy_(tensor.reshape(-1));
      ring_reduce(buf, n, count);
      ring_gather(buf, n, count);
      if (!direct) tensor.copy_(buf.narrow(0, 0, numel).view(tensor.sizes()));
      if (op == ReduceOp::kAvg) tensor.div_(size_);
    });
  }

  void broadcast(const at::Tensor& tensor, int root, TransferCount& count) override {
    guarded([&] {
      exchange_ids();
      const uint64_t bytes = tensor.numel() * tensor.element_size();
      if (hops_.layout == RingHops::Layout::kGloo) {
        std::vector<at::Tensor> tensors{tensor};
        c10d::BroadcastOptions opts;
        opts.rootRank = root;
        opts.timeout = timeout_;
        wait_work(pg_->broadcast(tensors, opts), root, "broadcast from");
        if (rank_ == root) {
          count.sent += bytes * (size_ - 1);
        } else {
          count.received += bytes;
        }
        return;
      }
      pipeline_broadcast(tensor, root, count);
    });
  }

  void barrier(TransferCount& count) override {
    if (hops_.layout == RingHops::Layout::kGloo) {
      guarded([&] {
        exchange_ids();
        c10d::BarrierOptions opts;
        opts.timeout = timeout_;
        wait_work(pg_->barrier(opts), -1, "barrier");
      });
      return;
    }
    all_reduce(at::zeros({1}, at::kInt), ReduceOp::kSum, count);
  }

  void begin(const CollectiveId& id) override {
    wire_ = WireId::of(id);
    if (!ids_on_) return;
    uint64_t h = wire_.tag_hash ^ (wire_.bytes * 0x9e3779b97f4a7c15ULL) ^ (wire_.seq * 0xff51afd7ed558ccdULL);
    h ^= (static_cast<uint64_t>(wire_.kind + 2) << 40) ^ (static_cast<uint64_t>(wire_.dtype + 2) << 50);
    salt_ = static_cast<uint32_t>(h ^ (h >> 32));
  }
  bool carries_ids() const override { return ids_on_; }

 private:
  using Clock = std::chrono::steady_clock;

  // A failure closes the shared-memory hops, so the neighbours fail at once instead of at their
  // timeout (as a closed Gloo connection makes them fail).
  template <typename F>
  void guarded(F&& body) {
    try {
      body();
      settle_ids();
    } catch (const std::exception& e) {
      abandon("rank " + std::to_string(rank_) + " failed: " + describe(e));
      throw;
    } catch (...) {
      abandon("");
      throw;
    }
  }

  // After a failure: the identity exchange in flight is dropped, the hops closed with `reason`.
  void abandon(const std::string& reason) {
    id_recvs_.clear();
    id_sends_.clear();
    close_hops(reason);
  }

  void close_hops(const std::string& reason) {
    if (hops_.in) hops_.in->close(reason);
    if (hops_.out) hops_.out->close(reason);
  }

  // See Note [Collective identity in the framing]: the identity exchange over the Gloo hops,
  // posted before the collective's data; settle_ids() waits for it and compares.
  void post_ids() {
    if (!ids_on_ || size_ < 2) return;
    const bool in_gloo = !hops_.in, out_gloo = !hops_.out;
    if (!in_gloo && !out_gloo) return;
    const int base = 0x40000000 | static_cast<int>((exchanges_++ & 0x07ffffff) << 1);
    const auto bytes_of = [](WireId& w) {
      return at::from_blob(&w, {static_cast<int64_t>(sizeof(WireId))}, at::TensorOptions().dtype(at::kByte));
    };
    id_out_ = wire_;
    // Forward: this rank's id to the next rank; the previous rank's id from it.
    if (in_gloo) id_recvs_.push_back({prev(), &id_from_prev_, post(bytes_of(id_from_prev_), prev(), base, false)});
    if (out_gloo) id_sends_.emplace_back(next(), post(bytes_of(id_out_), next(), base, /*send=*/true));
    // Backward, in a ring of more than two: to the previous rank, from the next.
    if (size_ > 2 && out_gloo) {
      id_recvs_.push_back({next(), &id_from_next_, post(bytes_of(id_from_next_), next(), base + 1, false)});
    }
    if (size_ > 2 && in_gloo) id_sends_.emplace_back(prev(), post(bytes_of(id_out_), prev(), base + 1, true));
  }

  void settle_ids() {
    if (id_recvs_.empty() && id_sends_.empty()) return;
    auto recvs = std::move(id_recvs_);
    auto sends = std::move(id_sends_);
    id_recvs_.clear();
    id_sends_.clear();
    // Every exchange completes before any comparison, so each neighbour has this rank's identity
    // (and can name the mismatch itself) even when this rank fails next.
    for (auto& r : recvs) wait_work(r.work, r.peer, "collective identity from");
    for (auto& [peer, work] : sends) wait_work(work, peer, "collective identity to");
    for (auto& r : recvs) {
      if (!r.into->same_collective(wire_))
        throw CollectiveMismatch(r.peer, mismatch_text(rank_, wire_, r.peer, *r.into));
    }
  }

  // A collective whose every message waits behind settle_ids() (Gloo's own broadcast and barrier).
  void exchange_ids() {
    post_ids();
    settle_ids();
  }

  c10::intrusive_ptr<c10d::Work> post(const at::Tensor& t, int peer, int tag, bool send) {
    std::vector<at::Tensor> v{t};
    try {
      return send ? pg_->send(v, peer, tag) : pg_->recv(v, peer, tag);
    } catch (const std::exception& e) {
      throw PeerError(peer, std::string(send ? "send to" : "receive from") + " rank " + std::to_string(peer) +
                                " failed: " + describe(e));
    }
  }

  int next() const { return mod(rank_ + 1, size_); }
  int prev() const { return mod(rank_ - 1, size_); }

  // After it, rank r's chunk r of `buf` (chunks of n elements) holds the sum over ranks.
  void ring_reduce(const at::Tensor& buf, int64_t n, TransferCount& count) {
    for (int s = 0; s < size_ - 1; ++s) {
      auto send_chunk = buf.narrow(0, mod(rank_ - s - 1, size_) * n, n);
      auto acc_chunk = buf.narrow(0, mod(rank_ - s - 2, size_) * n, n);
      if (hops_.layout == RingHops::Layout::kGloo) {
        gloo_reduce_step(send_chunk, acc_chunk, count);
      } else {
        step(send_chunk, acc_chunk, /*accumulate=*/true, count);
      }
    }
  }

  // Given rank r's chunk r of `buf`, fills every chunk.
  void ring_gather(const at::Tensor& buf, int64_t n, TransferCount& count) {
    // No compute to overlap here: one message per step moves the whole chunk fastest.
    for (int s = 0; s < size_ - 1; ++s) {
      auto send_chunk = buf.narrow(0, mod(rank_ - s, size_) * n, n);
      auto recv_chunk = buf.narrow(0, mod(rank_ - s - 1, size_) * n, n);
      if (hops_.layout == RingHops::Layout::kGloo) {
        gloo_exchange(send_chunk, recv_chunk, count);
      } else {
        step(send_chunk, recv_chunk, /*accumulate=*/false, count);
      }
    }
  }

  // One ring step with at least one shared-memory hop: sends `send` to the next rank and receives
  // the previous rank's chunk into `recv` (added to it with `accumulate`).
  void step(const at::Tensor& send, const at::Tensor& recv, bool accumulate, TransferCount& count) {
    const auto deadline = Clock::now() + timeout_;
    c10::intrusive_ptr<c10d::Work> sw, rw;
    at::Tensor scratch;
    if (!hops_.in) {
      scratch = accumulate ? at::empty_like(recv) : recv;
      rw = post_recv(scratch, prev());
    }
    if (!hops_.out) sw = post_send(send, next());
    settle_ids();
    const int64_t es = send.element_size();
    const int64_t piece = static_cast<int64_t>(ShmChannel::kSlotBytes) / es;
    const auto* src = static_cast<const uint8_t*>(send.data_ptr());
    for (int64_t off = 0; off < send.numel(); off += piece) {
      const int64_t len = std::min(piece, send.numel() - off);
      if (hops_.out) hops_.out->write(src + off * es, len * es, wire_, deadline);
      if (hops_.in) receive_piece(recv, off, len, accumulate, deadline);
    }
    if (rw) {
      wait_work(rw, prev(), "receive from");
      if (accumulate) recv.add_(scratch);
    }
    if (sw) wait_work(sw, next(), "send to");
    next_tag();
    count.sent += send.numel() * es;
    count.received += recv.numel() * es;
  }

  void receive_piece(const at::Tensor& recv, int64_t off, int64_t len, bool accumulate, Clock::time_point deadline) {
    auto part = recv.narrow(0, off, len);
    if (hops_.out) hops_.out->set_sender_waiting_for(prev());
    hops_.in->read(
        len * recv.element_size(), wire_,
        [&](const void* data) {
          if (accumulate) {
            part.add_(at::from_blob(const_cast<void*>(data), {len}, recv.options()));
          } else {
            std::memcpy(part.data_ptr(), data, len * recv.element_size());
          }
        },
        deadline);
    if (hops_.out) hops_.out->set_sender_waiting_for(-1);
  }

  // Broadcast without Gloo's: the root's tensor flows around the ring in slot-sized pieces.
  void pipeline_broadcast(const at::Tensor& tensor, int root, TransferCount& count) {
    settle_ids();
    const auto flat = tensor.view(-1);
    const int64_t es = flat.element_size();
    const int64_t piece = static_cast<int64_t>(ShmChannel::kSlotBytes) / es;
    for (int64_t off = 0; off < flat.numel(); off += piece) {
      const auto deadline = Clock::now() + timeout_;
      auto part = flat.narrow(0, off, std::min(piece, flat.numel() - off));
      const int64_t bytes = part.numel() * es;
      if (rank_ != root) {
        if (hops_.in) {
          receive_piece(flat, off, part.numel(), /*accumulate=*/false, deadline);
        } else {
          wait_work(post_recv(part, prev()), prev(), "receive from");
        }
        count.received += bytes;
      }
      if (next() != root) {
        if (hops_.out) {
          hops_.out->write(part.data_ptr(), bytes, wire_, deadline);
        } else {
          wait_work(post_send(part, next()), next(), "send to");
        }
        count.sent += bytes;
      }
      next_tag();
    }
  }

  // Gloo-only reduce-scatter step: segments, each segment's add overlapping the next's transfer.
  void gloo_reduce_step(const at::Tensor& send_chunk, const at::Tensor& acc_chunk, TransferCount& count) {
    const int64_t n = send_chunk.numel();
    const int64_t seg = segment_elems(send_chunk);
    at::Tensor scratch[2] = {at::empty({std::min(seg, n)}, send_chunk.options()),
                             at::empty({std::min(seg, n)}, send_chunk.options())};
    // Post segment k+1's transfer before adding segment k, so the add overlaps the wire.
    c10::intrusive_ptr<c10d::Work> pending_send, pending_recv;
    int64_t pending_off = -1, pending_len = 0;
    int slot = 0;
    for (int64_t off = 0;; off += seg) {
      c10::intrusive_ptr<c10d::Work> sw, rw;
      const bool more = off < n;
      const int64_t len = more ? std::min(seg, n - off) : 0;
      if (more) {
        rw = post_recv(scratch[slot].narrow(0, 0, len), prev());
        sw = post_send(send_chunk.narrow(0, off, len), next());
        count.sent += len * send_chunk.element_size();
        count.received += len * send_chunk.element_size();
        next_tag();
      }
      settle_ids();  // before any wait on data: a mismatched peer's data never comes (its tags differ)
      if (pending_off >= 0) {
        wait_work(pending_recv, prev(), "receive from");
        wait_work(pending_send, next(), "send to");
        acc_chunk.narrow(0, pending_off, pending_len).add_(scratch[1 - slot].narrow(0, 0, pending_len));
      }
      if (!more) break;
      pending_send = sw;
      pending_recv = rw;
      pending_off = off;
      pending_len = len;
      slot = 1 - slot;
    }
  }

  static std::shared_ptr<::gloo::transport::Device> make_device(const std::string& hostname) {
    if (!hostname.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      std::string first(ifname);
      first = first.substr(0, first.find(','));
      return c10d::ProcessGroupGloo::createDeviceForInterface(first);
    }
    return c10d::ProcessGroupGloo::createDefaultDevice();
  }

  static int64_t segment_elems(const at::Tensor& t) { return std::max<int64_t>(1, kSegmentBytes / t.element_size()); }

  // Data tags carry a digest of the collective's identity: a mismatched peer's data never matches
  // this rank's receives, so no message of another size reaches them while the identities are
  // being compared (Note [Collective identity in the framing]).
  int tag() const { return static_cast<int>((seq_ + salt_) & 0x3fffffff); }
  void next_tag() { ++seq_; }

  c10::intrusive_ptr<c10d::Work> post_send(const at::Tensor& t, int to) { return post(t, to, tag(), true); }
  c10::intrusive_ptr<c10d::Work> post_recv(const at::Tensor& t, int from) { return post(t, from, tag(), false); }

  void gloo_exchange(const at::Tensor& send_buf, const at::Tensor& recv_buf, TransferCount& count) {
    auto rw = post_recv(recv_buf, prev());
    auto sw = post_send(send_buf, next());
    settle_ids();
    wait_work(rw, prev(), "receive from");
    wait_work(sw, next(), "send to");
    count.sent += send_buf.numel() * send_buf.element_size();
    count.received += recv_buf.numel() * recv_buf.element_size();
    next_tag();
  }

  void wait_work(const c10::intrusive_ptr<c10d::Work>& work, int peer, const char* what) {
    bool ok = false;
    try {
      ok = work->wait(timeout_);
    } catch (const std::exception& e) {
      const std::string text = describe(e);
      std::string msg = std::string(what) + (peer >= 0 ? " rank " + std::to_string(peer) : "") + " failed: " + text;
      if (peer >= 0) throw PeerError(peer, msg, says_timed_out(text));
      if (says_timed_out(text)) throw TimeoutError(msg);
      throw DistError(msg);
    }
    if (!ok) {
      std::string msg = std::string(what) + (peer >= 0 ? " rank " + std::to_string(peer) : "") +
                        " did not complete within " + std::to_string(timeout_.count()) + " ms";
      if (peer >= 0) throw PeerError(peer, msg, /*timed_out=*/true);
      throw TimeoutError(msg);
    }
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  RingHops hops_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  uint64_t seq_ = 0;
  // Note [Collective identity in the framing]
  bool ids_on_ = collective_ids_enabled();
  WireId wire_;                                  // the collective in progress
  WireId id_out_, id_from_prev_, id_from_next_;  // the Gloo identity exchange's buffers
  uint64_t exchanges_ = 0;
  uint32_t salt_ = 0;  // see tag()
  struct IdRecv {
    int peer;
    WireId* into;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<IdRecv> id_recvs_;
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> id_sends_;
};

// One rank: every collective is a local copy.
class LocalTransport final : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend_name() const override { return "local"; }
  void all_gather(const at::Tensor& output, const at::Tensor& input, TransferCount&) override {
    if (output.data_ptr() != input.data_ptr()) output.copy_(input.view(-1));
  }
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp, TransferCount&) override {
    if (output.data_ptr() != input.data_ptr()) output.copy_(input.view(-1));
  }
  void all_reduce(const at::Tensor&, ReduceOp, TransferCount&) override {}
  void broadcast(const at::Tensor&, int, TransferCount&) override {}
  void barrier(TransferCount&) override {}
};

}  // namespace

IdCheck collective_id_check() {
  const char* v = std::getenv("FSDP_COLLECTIVE_IDS");
  const std::string mode = v == nullptr ? "" : v;
  if (mode.empty() || mode == "1") return IdCheck::kAuto;
  if (mode == "queue") return IdCheck::kQueue;
  if (mode == "0") return IdCheck::kOff;
  throw ConfigError(
      "fsdp: FSDP_COLLECTIVE_IDS must be 1 (the default: identities in the transport's framing), "
      "queue (checked in the communicator's queue) or 0 (off), got \"" +
      mode + "\"");
}

bool collective_ids_enabled() { return collective_id_check() == IdCheck::kAuto; }

// Note [Flight recorder off]
// c10d's flight recorder (on by default, 2000 entries) records every collective of every process
// group, capturing a traceback each time, and its record path inserts the group's status into a
// std::map before taking its mutex: the first collectives of two groups issued at once from two
// threads (our communicators each have their own worker) corrupt that map and crash the process
// (seen as a SIGSEGV in std::_Rb_tree_insert_and_rebalance under ProcessGroupGloo::enqueue). Our
// communicators keep their own counters and error context, so the recorder is turned off before
// the first process group is made, unless the user set TORCH_FR_BUFFER_SIZE themselves.
void disable_flight_recorder_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("TORCH_FR_BUFFER_SIZE") == nullptr && std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE") == nullptr) {
      ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
    }
  });
}

std::unique_ptr<Transport> make_local_transport() { return std::make_unique<LocalTransport>(); }

std::unique_ptr<Transport> make_ring_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               const CpuTransportOptions& options, RingHops hops) {
  return std::make_unique<RingTransport>(store, rank, size, options, std::move(hops));
}

}  // namespace fsdp
