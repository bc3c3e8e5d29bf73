// Training on CUDA parameters: the sharded core with its buffers in device memory (freed and
// regrown by the caching allocator), collectives ordered on the issuing stream, the CUDA kernels
// (fused AdamW, mixed-precision copy-in / copy-out, clipping), the host tier's pinned copies and
// CPU optimizer step, the disk tier behind a device, and checkpoints that move between devices.
// Each GPU test compares against the same training on the CPU or without offload and skips
// without enough CUDA devices; the first test runs everywhere (it needs no GPU).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <functional>
#include <thread>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "offload/device_stager.h"
#include "offload/tier_tensors.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"

namespace fsdp {
namespace {

int gpu_count() {
  const auto& hooks = at::detail::getCUDAHooks();
  return hooks.hasCUDA() ? hooks.getNumGPUs() : 0;
}

#define REQUIRE_GPUS(n) \
  if (gpu_count() < (n)) GTEST_SKIP() << "needs " << (n) << " CUDA device(s); this machine has " << gpu_count()

const c10::Device kCpu(c10::kCPU);
const c10::Device kGpu0(c10::kCUDA, 0);

struct Config {
  std::optional<at::ScalarType> param_dtype;
  std::optional<OffloadPolicy> offload;
};

using Job = testing::ShardedModel;

// Built on the CPU from one seed and then moved, so every device starts from the same values.
Job build(DeviceMesh& mesh, const c10::Device& device, const Config& config) {
  testing::ShardedModelOptions o;
  o.net.in = 7;
  o.net.dim = 61;
  o.net.hidden = 333;
  o.net.out = 5;
  o.net.blocks = 3;
  o.seed = 3;
  o.move_to = device;
  o.shard.mp_policy(MixedPrecisionPolicy().param_dtype(config.param_dtype));
  o.root_shard = o.shard;
  if (config.param_dtype) o.root_shard->mp_policy().output_dtype(at::kFloat);
  if (config.offload) o.root_shard->offload(*config.offload);
  o.adamw = AdamWOptions(1e-2).weight_decay(0.1);
  return testing::make_sharded_model(mesh, o);
}

// One step on this rank's part of a global batch drawn on the CPU (the same data on any device).
double step(Job& r, int64_t s, int rank, int world, const c10::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + s);
  auto x = at::randn({8, 7}, gen), y = at::randn({8, 5}, gen);
  const int64_t local = 8 / world;
  return testing::train_on_batch(r, x.narrow(0, rank * local, local).to(device),
                                 y.narrow(0, rank * local, local).to(device), /*clip=*/0.5);
}

// This rank's master shard of each flat param, in host memory.
std::vector<at::Tensor> shards(Job& r) {
  std::vector<at::Tensor> out;
  for (const auto& unit : fsdp::testing::units(*r.root)) {
    for (auto& fp : unit->flat_params()) out.push_back(fp->sharded_param().cpu());
  }
  return out;
}

at::Tensor masters(Job& r) { return at::cat(shards(r)); }

struct Result {
  std::vector<double> losses;
  at::Tensor params;              // master shards after training (host memory)
  std::vector<at::Tensor> flats;  // the same, per flat param
  std::vector<int64_t> numels;    // each flat param's unpadded length
};

void finish(Result& res, Job& r) {
  res.flats = shards(r);
  res.params = at::cat(res.flats);
  for (const auto& unit : fsdp::testing::units(*r.root)) {
    for (auto& fp : unit->flat_params()) res.numels.push_back(fp->numel());
  }
}

Result train_single(const c10::Device& device, const Config& config, int steps,
                    const std::function<void(Job&)>& check = nullptr) {
  at::set_num_threads(1);
  auto dist = Dist::single(InitOptions().device(device.is_cuda() ? "cuda" : "cpu"));
  DeviceMesh mesh(dist);
  Job r = build(mesh, device, config);
  Result res;
  for (int s = 0; s < steps; ++s) res.losses.push_back(step(r, s, 0, 1, device));
  if (check) check(r);
  finish(res, r);
  return res;
}

void expect_losses_close(const Result& a, const Result& b, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], atol + rtol * std::abs(b.losses[i])) << what << ": loss of step " << i;
  }
}

// Params after AdamW on two devices. AdamW divides each gradient element by its own running
// magnitude, so an element whose gradient is at rounding level (another summation order flips its
// sign) moves by up to lr per step either way, however close the rest of the arithmetic is. So
// all but `max_fraction` of the elements agree within `atol`, and every one within `bound` (two lr
// per step: the two directions).
void expect_params_close(const at::Tensor& a, const at::Tensor& b, double atol, double max_fraction, double bound,
                         const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor diff = (a - b).abs();
  const double worst = diff.max().item<double>();
  const double off = diff.gt(atol).to(at::kDouble).mean().item<double>();
  const std::string stats = ": " + std::to_string(100 * off) + "% of " + std::to_string(diff.numel()) +
                            " elements differ by more than " + std::to_string(atol) + ", the most by " +
                            std::to_string(worst) + ", mean " + std::to_string(diff.mean().item<double>());
  EXPECT_LE(off, max_fraction) << what << stats;
  EXPECT_LE(worst, bound) << what << stats;
}

// Tight agreement, for runs whose arithmetic differs only in rounding of the optimizer step
// (the same gradients): every element within `atol` + `rtol` of its value.
void expect_close(const Result& a, const Result& b, double rtol, double atol, const std::string& what) {
  expect_losses_close(a, b, rtol, atol, what);
  ASSERT_EQ(a.params.sizes(), b.params.sizes()) << what;
  const double diff = (a.params - b.params).abs().max().item<double>();
  EXPECT_TRUE(at::allclose(a.params, b.params, rtol, atol)) << what << ": params differ by up to " << diff;
}

// Training moved the params by far more than the tolerances: agreement above is not vacuous.
void expect_trained(const Result& trained, const Result& initial, double atol) {
  const double moved = (trained.params - initial.params).abs().max().item<double>();
  EXPECT_GT(moved, 20 * atol) << "training barely moved the params; the comparisons would be vacuous";
}

TEST(CudaTraining, CudaDeviceWithoutAGpuIsAClearError) {
  if (gpu_count() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  try {
    Dist::single(InitOptions().device("cuda"));
    FAIL() << "a CUDA process group without a GPU was made";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("InitOptions::device is \"cuda\" but no CUDA device is usable"),
              std::string::npos)
        << e.what();
  }
}

TEST(CudaTraining, OneGpuMatchesTheCpu) {
  REQUIRE_GPUS(1);
  constexpr int kSteps = 5;
  // fp32: the same arithmetic up to summation order.
  const Result cpu = train_single(kCpu, {}, kSteps);
  const Result gpu = train_single(kGpu0, {}, kSteps);
  // The gradients come from other kernels (summation order), so the params are compared as
  // expect_params_close explains: lr 1e-2 (build), 5 steps.
  constexpr double kLr = 1e-2, kBound = 2 * kLr * kSteps;
  expect_losses_close(gpu, cpu, 1e-4, 1e-5, "fp32, cuda vs cpu");
  expect_params_close(gpu.params, cpu.params, 1e-5, 1e-3, kBound, "fp32, cuda vs cpu");
  expect_trained(gpu, train_single(kCpu, {}, 0), 1e-5);

  // bf16 compute: the gathered buffers are separate from the master, freed after each use and
  // regrown (Note [Freeing device buffers]); copy-in, copy-out and the bf16 matmuls differ from
  // the CPU's by rounding only.
  Config bf16{at::kBFloat16, std::nullopt};
  const Result cpu16 = train_single(kCpu, bf16, kSteps);
  const Result gpu16 = train_single(kGpu0, bf16, kSteps, [](Job& r) {
    for (const auto& unit : fsdp::testing::units(*r.root)) {
      for (auto& fp : unit->flat_params()) {
        EXPECT_TRUE(fp->sharded_param().is_cuda());
        EXPECT_EQ(fp->unsharded_bytes(), 0) << fp->config().tag << " kept its gathered buffer after the step";
        EXPECT_EQ(fp->unsharded_grad_bytes(), 0) << fp->config().tag << " kept its gradient buffer";
      }
    }
    for (auto& st : r.optim->states()) {
      for (const auto& [name, t] : st.tensors) EXPECT_TRUE(t.is_cuda()) << name;
    }
  });
  expect_losses_close(gpu16, cpu16, 2e-2, 2e-2, "bf16, cuda vs cpu");
  expect_params_close(gpu16.params, cpu16.params, 2e-3, 2e-2, kBound, "bf16, cuda vs cpu");
}

OffloadPolicy all_in(OffloadTier tier, const std::string& dir = "") {
  auto p = OffloadPolicy().params(tier).grads(tier).optimizer_state(tier);
  // The smallest budget the optimizer step streams in: three 4 KiB pages (read-ahead, current,
  // write-behind) of each of the four tensors it streams (master, grad, exp_avg, exp_avg_sq).
  if (tier == OffloadTier::kDisk) p.dir(dir).memory_budget_bytes(3 * 4 * 4096);
  return p;
}

TEST(CudaTraining, HostAndDiskTiersMatchNoOffloadOnOneGpu) {
  REQUIRE_GPUS(1);
  constexpr int kSteps = 4;
  const Result none = train_single(kGpu0, {}, kSteps);
  // The optimizer steps on the CPU (the CPU twin of the fused AdamW kernel): equal up to the
  // kernels' rounding (Note [Twin numerics]).
  const Result host = train_single(kGpu0, {std::nullopt, all_in(OffloadTier::kHost)}, kSteps, [](Job& r) {
    for (const auto& unit : fsdp::testing::units(*r.root)) {
      for (auto& fp : unit->flat_params()) {
        ASSERT_TRUE(fp->offload().stager != nullptr);
        EXPECT_STREQ(fp->offload().stager->name(), "cuda");
        EXPECT_TRUE(fp->sharded_param().is_cpu());
        EXPECT_TRUE(fp->sharded_param().is_pinned());
        EXPECT_TRUE(fp->sharded_grad().is_pinned());
      }
    }
    for (auto& st : r.optim->states()) {
      for (const auto& [name, t] : st.tensors) EXPECT_TRUE(t.is_pinned()) << name;
    }
  });
  expect_close(host, none, 1e-5, 1e-6, "host tier vs no offload on cuda");

  const std::string dir = testing::temp_path("cuda-disk");
  const Result disk = train_single(kGpu0, {std::nullopt, all_in(OffloadTier::kDisk, dir)}, kSteps, [](Job& r) {
    for (const auto& unit : fsdp::testing::units(*r.root)) {
      for (auto& fp : unit->flat_params()) EXPECT_TRUE(offload::is_disk_backed(fp->sharded_param()));
    }
  });
  expect_close(disk, none, 1e-5, 1e-6, "disk tier vs no offload on cuda");
  expect_trained(none, train_single(kGpu0, {}, 0), 1e-6);
  io::remove_tree(dir);

  // The optimizer steps where the master lives: a partial offload on a device is refused.
  auto dist = Dist::single(InitOptions().device("cuda"));
  DeviceMesh mesh(dist);
  try {
    build(mesh, kGpu0, {std::nullopt, OffloadPolicy().params(OffloadTier::kHost).grads(OffloadTier::kHost)});
    FAIL() << "a partial offload on cuda was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer_state=none"), std::string::npos) << e.what();
  }
}

TEST(CudaTraining, CheckpointsMoveBetweenGpuAndCpu) {
  REQUIRE_GPUS(1);
  at::set_num_threads(1);
  const std::string root_dir = testing::temp_path("cuda-ckpt");
  auto gpu_dist = Dist::single(InitOptions().device("cuda"));
  auto cpu_dist = Dist::single();
  DeviceMesh gpu_mesh(gpu_dist), cpu_mesh(cpu_dist);
  Job trained = build(gpu_mesh, kGpu0, {});
  for (int s = 0; s < 3; ++s) step(trained, s, 0, 1, kGpu0);
  checkpoint::save(root_dir, "step3", *trained.root, trained.optim.get(), checkpoint::TrainState{});
  const std::string dir = checkpoint::resolve(root_dir, "latest");

  for (const c10::Device& device : {kGpu0, kCpu}) {
    Job fresh = build(device.is_cuda() ? gpu_mesh : cpu_mesh, device, {});
    step(fresh, 0, 0, 1, device);  // creates optimizer state to overwrite
    checkpoint::load(dir, *fresh.root, fresh.optim.get());
    EXPECT_TRUE(at::equal(masters(fresh), masters(trained))) << "params after loading on " << device;
    ASSERT_EQ(fresh.optim->states().size(), trained.optim->states().size());
    for (size_t i = 0; i < trained.optim->states().size(); ++i) {
      const auto& want = trained.optim->states()[i];
      const auto& got = fresh.optim->states()[i];
      EXPECT_EQ(got.step, want.step);
      for (const auto& [name, t] : want.tensors) {
        ASSERT_TRUE(got.tensors.count(name)) << name;
        EXPECT_EQ(got.tensors.at(name).device(), device) << name;
        EXPECT_TRUE(at::equal(got.tensors.at(name).cpu(), t.cpu())) << name << " after loading on " << device;
      }
    }
  }
  io::remove_tree(root_dir);
}

TEST(CudaTraining, FullShardOnTwoGpusMatchesOneGpu) {
  REQUIRE_GPUS(2);
  constexpr int kSteps = 4;
  const Result one = train_single(kGpu0, {}, kSteps);
  const std::string path = testing::temp_path("cuda-store");
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  std::vector<Result> results(2);
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        at::set_num_threads(1);
        const c10::Device device(c10::kCUDA, rank);
        c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);  // before the process group
        auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
        auto dist = Dist::from_store(
            store, rank, 2, InitOptions().device("cuda").check_collectives(true).timeout(std::chrono::seconds(60)));
        EXPECT_EQ(dist->compute_device(), device);
        DeviceMesh mesh(dist);
        Job r = build(mesh, device, {});
        for (int s = 0; s < kSteps; ++s) results[rank].losses.push_back(step(r, s, rank, 2, device));
        finish(results[rank], r);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
  // Each rank's loss is on its half of the batch: their mean is the one-GPU loss. Rank 0's shard
  // followed by rank 1's is the one-GPU flat buffer (padding aside).
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR((results[0].losses[s] + results[1].losses[s]) / 2, one.losses[s], 1e-5 + 1e-4 * one.losses[s]) << s;
  }
  ASSERT_EQ(results[0].flats.size(), one.flats.size());
  std::vector<at::Tensor> two, ones;
  for (size_t i = 0; i < one.flats.size(); ++i) {
    const int64_t n = one.numels[i];
    two.push_back(at::cat({results[0].flats[i], results[1].flats[i]}).narrow(0, 0, n));
    ones.push_back(one.flats[i].narrow(0, 0, n));
  }
  // The reduce-scatter sums the two halves' gradients in another order than one GPU's backward.
  expect_params_close(at::cat(two), at::cat(ones), 1e-5, 1e-3, 2 * 1e-2 * kSteps, "two GPUs vs one");
}

}  // namespace
}  // namespace fsdp
