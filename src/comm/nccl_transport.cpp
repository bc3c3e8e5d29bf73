// NcclTransport: CUDA tensors over ProcessGroupNCCL's native collectives (NCCL's all-gather and
// reduce-scatter already move (N-1)/N of the buffer per rank). Built only with CUDA; see
// nccl_unavailable.cpp for the CPU-only build.
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "base/strings.h"
#include "comm/transport.h"

namespace fsdp {
namespace {

using base::first_line;

class NcclTransport final : public Transport {
 public:
  NcclTransport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout), device_(c10::kCUDA, c10::cuda::current_device()) {
    disable_flight_recorder_once();
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  }
  ~NcclTransport() override {
    try {
      pg_->shutdown();  // NCCL communicators must be torn down before the process group goes
    } catch (...) {
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "nccl"; }
  c10::Device device() const override { return device_; }

  void all_gather(const at::Tensor& output, const at::Tensor& input, TransferCount& count) override {
    at::Tensor out = output, in = input;
    wait(pg_->_allgather_base(out, in), "all_gather");
    count.sent += input.numel() * input.element_size() * (size_ - 1);
    count.received += input.numel() * input.element_size() * (size_ - 1);
  }
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, TransferCount& count) override {
    at::Tensor out = output, in = input;
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    opts.timeout = timeout_;
    wait(pg_->_reduce_scatter_base(out, in, opts), "reduce_scatter");
    count.sent += output.numel() * output.element_size() * (size_ - 1);
    count.received += output.numel() * output.element_size() * (size_ - 1);
  }
  void all_reduce(const at::Tensor& tensor, ReduceOp op, TransferCount& count) override {
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    opts.timeout = timeout_;
    wait(pg_->allreduce(ts, opts), "all_reduce");
    const uint64_t moved = 2 * (size_ - 1) * (tensor.numel() * tensor.element_size() / size_);
    count.sent += moved;
    count.received += moved;
  }
  void broadcast(const at::Tensor& tensor, int root, TransferCount& count) override {
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeout_;
    wait(pg_->broadcast(ts, opts), "broadcast");
    const uint64_t bytes = tensor.numel() * tensor.element_size();
    if (rank_ == root) count.sent += bytes;
    else count.received += bytes;
  }
  void barrier(TransferCount&) override {
    c10d::BarrierOptions opts;
    opts.timeout = timeout_;
    opts.device_ids = {device_.index()};  // else the group guesses a device from the rank
    wait(pg_->barrier(opts), "barrier");
  }

 private:
  // With a timeout, WorkNCCL::wait blocks this (the worker) thread until the collective has
  // completed, and throws when the timeout passes rather than returning false.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
    try {
      if (!work->wait(timeout_)) throw TimeoutError(std::string(what) + " did not complete in time");
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string line = first_line(e);
      if (line.find("timed out") != std::string::npos || line.find("Timeout") != std::string::npos) {
        throw TimeoutError(std::string(what) + " did not complete within " + std::to_string(timeout_.count()) +
                           " ms: " + line);
      }
      throw DistError(std::string(what) + " failed: " + line);
    }
  }

  int rank_, size_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;  // the CUDA device current when the group was made
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               std::chrono::milliseconds timeout) {
  return std::make_unique<NcclTransport>(store, rank, size, timeout);
}

}  // namespace fsdp
