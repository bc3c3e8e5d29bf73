// NCCL transport (CUDA builds): all-gather and reduce-scatter of CUDA tensors, and an all-reduce of
// a host tensor, on 2 GPUs against a local reference. Skips without 2 GPUs, as on CPU-only machines.
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <thread>

#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

TEST(Nccl, AllGatherAndReduceScatterOnTwoGpus) {
  if (at::detail::getCUDAHooks().getNumGPUs() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const std::string path = testing::temp_path("nccl-store");
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        const auto dev = at::Device(at::kCUDA, r);
        auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
        auto dist = Dist::from_store(store, r, 2, InitOptions().device("cuda").timeout(std::chrono::seconds(60)));
        auto in = at::full({5}, static_cast<float>(r + 1), at::TensorOptions().device(dev));
        auto out = at::empty({10}, in.options());
        dist->world().all_gather(out, in, "ag").wait();
        auto expect = at::cat({at::full({5}, 1.0f), at::full({5}, 2.0f)});
        if (!at::equal(out.cpu(), expect)) errors[r] = "all_gather mismatch";
        auto full = at::arange(10, at::TensorOptions().dtype(at::kFloat).device(dev)) * (r + 1);
        auto shard = at::empty({5}, full.options());
        dist->world().reduce_scatter(shard, full, ReduceOp::kSum, "rs").wait();
        if (!at::equal(shard.cpu(), at::arange(5 * r, 5 * r + 5, at::kFloat) * 3))
          errors[r] = "reduce_scatter mismatch";
        // Host tensors (flags, norms) travel through the device and come back in place.
        auto host = at::full({3}, static_cast<double>(r + 1), at::kDouble);
        dist->world().all_reduce(host, ReduceOp::kSum, "host").wait();
        if (!host.is_cpu() || !at::equal(host, at::full({3}, 3.0, at::kDouble))) errors[r] = "host all_reduce mismatch";
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

TEST(Nccl, UnknownDeviceIsRejected) {
  const std::string path = testing::temp_path("device-store");
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
        Dist::from_store(store, r, 2, InitOptions().device("tpu").timeout(std::chrono::seconds(5)));
      } catch (const ConfigError& e) {
        errors[r] = e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("wrong error type: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("must be \"cpu\" or \"cuda\", got \"tpu\""), std::string::npos) << errors[r];
}

}  // namespace
}  // namespace fsdp
