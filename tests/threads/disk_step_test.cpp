// The step after backward with the optimizer state in the disk tier (Note [The disk tier around
// the step after backward] in src/optim/optim.cpp): what the backward reads ahead, and when what
// it read is no longer current. Each case is compared bitwise with the same sequence in memory.
// Without a memory budget, the step still holds three chunks at most.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "fsdp/offload.h"
#include "offload_job.h"
#include "shard/testing.h"
#include "support/ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {

using namespace offload_job;

// Runs `body` on 2 thread ranks with the job built for `offload`; returns each rank's fingerprint
// of the losses `body` returns and the final params and state.
std::vector<std::string> run(const std::optional<OffloadPolicy>& offload,
                             const std::function<std::vector<double>(Job&, int rank)>& body) {
  std::vector<std::string> prints(kWorld);
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, offload);
        const auto losses = body(j, dist->rank());
        prints[dist->rank()] = testing::state_bytes(losses, *j.root, j.optim.get());
      },
      std::chrono::seconds(60));
  return prints;
}

// This rank's part of batch `seed`: its loss, backward run.
at::Tensor backward(Job& j, uint64_t seed, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
  const int64_t local = kGlobalBatch / kWorld;
  at::Tensor loss =
      at::mse_loss(fsdp::call(j.model, x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local));
  loss.backward();
  return loss;
}

void clip_and_step(Job& j) {
  clip_grad_norm(*j.root, 0.5);
  j.optim->step();
  j.optim->zero_grad();
}

void expect_equal(const std::vector<std::string>& reference, const std::vector<std::string>& got,
                  const std::string& what) {
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_GT(reference[r].size(), 1000u);
    EXPECT_TRUE(reference[r] == got[r]) << "rank " << r << ": " << what;
  }
}

// The backward reads the state's first chunks ahead, and a step skipped after its backward
// (zero_grad without step, as a GradScaler skips) drops what was read for it.
TEST(DiskStep, StepAfterBackwardReadsTheStateDuringTheBackward) {
  const std::string dir = testing::temp_path("disk-step-read-ahead");
  const auto policy = OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(dir).memory_budget_bytes(kBudget);
  auto body = [](bool disk) {
    return [disk](Job& j, int rank) {
      std::vector<double> losses;
      for (int64_t step = 0; step < 4; ++step) {
        const auto before = offload_io(*j.root);
        at::Tensor loss = backward(j, 7 + step, rank);
        if (disk && step >= 1) {
          // The master follows the state here, so no gather reads the disk: what the tier reads
          // during the backward is the optimizer's read ahead (counted once complete).
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while ((offload_io(*j.root) - before).disk_read == 0 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          EXPECT_GT((offload_io(*j.root) - before).disk_read, 0) << "step " << step << ": nothing read ahead";
        }
        losses.push_back(loss.item<double>());
        if (step == 2) {
          j.optim->zero_grad();  // skipped: no update
        } else {
          clip_and_step(j);
        }
      }
      return losses;
    };
  };
  expect_equal(run(std::nullopt, body(false)), run(policy, body(true)), "the read ahead changed the result");
  io::remove_tree(dir);
}

// A checkpoint loaded between a backward and its step() writes the state and master the backward
// read ahead: the step uses the loaded values.
TEST(DiskStep, CheckpointLoadedBetweenBackwardAndStepIsWhatSteps) {
  const std::string dir = testing::temp_path("disk-step-load-before-step");
  io::make_dirs(dir);
  auto body = [&](const std::string& ckpt) {
    return [ckpt](Job& j, int rank) {
      train_step(j, 0, rank);
      checkpoint::TrainState st;
      st.step = 1;
      checkpoint::save(ckpt, "step-1", *j.root, j.optim.get(), st);
      train_step(j, 1, rank);
      at::Tensor loss = backward(j, 9, rank);  // with the disk tier: the state's first chunks are read ahead now
      checkpoint::load(checkpoint::resolve(ckpt, "latest"), *j.root, j.optim.get());
      clip_and_step(j);
      return std::vector<double>{loss.item<double>()};
    };
  };
  const auto disk = OffloadPolicy()
                        .params(OffloadTier::kDisk)
                        .optimizer_state(OffloadTier::kDisk)
                        .dir(io::join(dir, "offload"))
                        .memory_budget_bytes(kBudget);
  expect_equal(run(std::nullopt, body(io::join(dir, "memory"))), run(disk, body(io::join(dir, "disk"))),
               "the step used what was read before the load");
  io::remove_tree(dir);
}

// With no memory_budget_bytes the step streams 4 MiB per tensor and holds three chunks at most
// (read-ahead, current, write-behind), whatever the disk's pace: before, its write-behind grew
// without bound when the step outran the disk, 0.6 GiB above the plan at 0.5B. A shard of nine
// chunks here; unbounded, the writes queued behind a step of 12 MiB chunks reached most of them.
TEST(DiskStep, WithoutABudgetTheStepHoldsThreeChunks) {
  const std::string dir = testing::temp_path("disk-step-no-budget");
  constexpr int64_t kChunk = int64_t{4} << 20;  // the tier's chunk per tensor without a budget
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        testing::ShardedModelOptions o;
        o.net = net_options(/*meta=*/true);
        o.net.dim = 1024;
        o.net.hidden = 8192;  // 16.8M params: 8.4M per rank, nine chunks of 1M elements
        o.net.blocks = 1;
        o.shard.init(init::normal(0.02, 11));
        o.root_shard = o.shard;
        o.root_shard->offload(OffloadPolicy()
                                  .params(OffloadTier::kDisk)
                                  .optimizer_state(OffloadTier::kDisk)
                                  .dir(io::join(dir, std::to_string(dist->rank()))));
        o.adamw = AdamWOptions(1e-3);
        Job j = testing::make_sharded_model(mesh, o);
        fsdp::set_disk_tier_audit(*j.root, true);
        for (int64_t step = 0; step < 2; ++step) train_step(j, step, dist->rank());
        const auto stats = disk_tier_stats(*j.root);
        EXPECT_EQ(stats.budget_bytes, 0);
        EXPECT_EQ(stats.chunk_bytes, kChunk);
        EXPECT_GT(stats.peak_resident_bytes, 2 * 3 * kChunk) << "the audit saw less than two chunks: vacuous";
        EXPECT_LE(stats.peak_resident_bytes, 3 * 3 * kChunk)
            << "rank " << dist->rank() << ": the step held more than three chunks of master and two states";
      },
      std::chrono::seconds(120));
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
