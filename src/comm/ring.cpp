// GlooRingTransport: CPU collectives as rings over Gloo's point-to-point send/recv.
//
// LibTorch's Gloo backend implements reduce_scatter_tensor as a full all-reduce plus a copy, which
// moves about 2(N-1)/N of the buffer per rank instead of (N-1)/N; its all-gather into a flat tensor
// goes through an extra staging copy. Rings over send/recv move exactly (N-1)/N of the buffer per
// rank and write straight into the caller's chunks. See Note [Ring schedule].
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdlib>
#include <mutex>
#include <sstream>

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

class GlooRingTransport final : public Transport {
 public:
  GlooRingTransport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    const GlooTransportOptions& options)
      : rank_(rank), size_(size), timeout_(options.timeout) {
    disable_flight_recorder_once();
    auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
    opts->threads = options.threads;
    opts->devices.push_back(make_device(options.hostname));
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "gloo"; }

  void all_gather(const at::Tensor& output, const at::Tensor& input, TransferCount& count) override {
    const int64_t n = input.numel();
    auto mine = output.narrow(0, rank_ * n, n);
    if (mine.data_ptr() != input.data_ptr()) mine.copy_(input.view(-1));
    const int next = mod(rank_ + 1, size_), prev = mod(rank_ - 1, size_);
    // No compute to overlap here: one message per step moves the whole chunk fastest.
    for (int s = 0; s < size_ - 1; ++s) {
      exchange(output.narrow(0, mod(rank_ - s, size_) * n, n), next, output.narrow(0, mod(rank_ - s - 1, size_) * n, n),
               prev, count);
    }
  }

  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, TransferCount& count) override {
    const int64_t n = output.numel();
    const int next = mod(rank_ + 1, size_), prev = mod(rank_ - 1, size_);
    const int64_t seg = segment_elems(output);
    at::Tensor scratch[2] = {at::empty({std::min(seg, n)}, input.options()),
                             at::empty({std::min(seg, n)}, input.options())};
    for (int s = 0; s < size_ - 1; ++s) {
      auto send_chunk = input.narrow(0, mod(rank_ - s - 1, size_) * n, n);
      auto acc_chunk = input.narrow(0, mod(rank_ - s - 2, size_) * n, n);
      // Post segment k+1's transfer before adding segment k, so the add overlaps the wire.
      c10::intrusive_ptr<c10d::Work> pending_send, pending_recv;
      int64_t pending_off = -1, pending_len = 0;
      int slot = 0;
      for (int64_t off = 0;; off += seg) {
        c10::intrusive_ptr<c10d::Work> sw, rw;
        const bool more = off < n;
        const int64_t len = more ? std::min(seg, n - off) : 0;
        if (more) {
          auto recv_buf = scratch[slot].narrow(0, 0, len);
          rw = post_recv(recv_buf, prev);
          sw = post_send(send_chunk.narrow(0, off, len), next);
          count.sent += len * input.element_size();
          count.received += len * input.element_size();
          next_tag();
        }
        if (pending_off >= 0) {
          wait_work(pending_recv, prev, "receive from");
          wait_work(pending_send, next, "send to");
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
    auto mine = input.narrow(0, rank_ * n, n);
    output.copy_(mine);
    if (op == ReduceOp::kAvg) output.div_(size_);
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op, TransferCount& count) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = timeout_;
    wait_work(pg_->allreduce(tensors, opts), -1, "all_reduce");
    if (op == ReduceOp::kAvg) tensor.div_(size_);
    // Gloo's ring all-reduce: a reduce-scatter then an all-gather, (N-1)/N of the buffer each.
    const uint64_t moved = 2 * (size_ - 1) * (tensor.numel() * tensor.element_size() / size_);
    count.sent += moved;
    count.received += moved;
  }

  void broadcast(const at::Tensor& tensor, int root, TransferCount& count) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeout_;
    wait_work(pg_->broadcast(tensors, opts), root, "broadcast from");
    const uint64_t bytes = tensor.numel() * tensor.element_size();
    if (rank_ == root) {
      count.sent += bytes * (size_ - 1);
    } else {
      count.received += bytes;
    }
  }

  void barrier(TransferCount&) override {
    c10d::BarrierOptions opts;
    opts.timeout = timeout_;
    wait_work(pg_->barrier(opts), -1, "barrier");
  }

 private:
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

  int tag() const { return static_cast<int>(seq_ & 0x3fffffff); }
  void next_tag() { ++seq_; }

  c10::intrusive_ptr<c10d::Work> post_send(const at::Tensor& t, int to) {
    std::vector<at::Tensor> v{t};
    try {
      return pg_->send(v, to, tag());
    } catch (const std::exception& e) {
      throw PeerError(to, "send to rank " + std::to_string(to) + " failed: " + describe(e));
    }
  }
  c10::intrusive_ptr<c10d::Work> post_recv(const at::Tensor& t, int from) {
    std::vector<at::Tensor> v{t};
    try {
      return pg_->recv(v, from, tag());
    } catch (const std::exception& e) {
      throw PeerError(from, "receive from rank " + std::to_string(from) + " failed: " + describe(e));
    }
  }

  void exchange(const at::Tensor& send_buf, int to, const at::Tensor& recv_buf, int from, TransferCount& count) {
    auto rw = post_recv(recv_buf, from);
    auto sw = post_send(send_buf, to);
    wait_work(rw, from, "receive from");
    wait_work(sw, to, "send to");
    count.sent += send_buf.numel() * send_buf.element_size();
    count.received += recv_buf.numel() * recv_buf.element_size();
    next_tag();
  }

  void wait_work(const c10::intrusive_ptr<c10d::Work>& work, int peer, const char* what) {
    bool ok = false;
    try {
      ok = work->wait(timeout_);
    } catch (const std::exception& e) {
      std::string msg =
          std::string(what) + (peer >= 0 ? " rank " + std::to_string(peer) : "") + " failed: " + describe(e);
      if (peer >= 0) throw PeerError(peer, msg);
      throw DistError(msg);
    }
    if (!ok) {
      std::string msg = std::string(what) + (peer >= 0 ? " rank " + std::to_string(peer) : "") +
                        " did not complete within " + std::to_string(timeout_.count()) + " ms";
      if (peer >= 0) throw PeerError(peer, msg);
      throw TimeoutError(msg);
    }
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  uint64_t seq_ = 0;
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

std::unique_ptr<Transport> make_gloo_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               const GlooTransportOptions& options) {
  return std::make_unique<GlooRingTransport>(store, rank, size, options);
}

}  // namespace fsdp
