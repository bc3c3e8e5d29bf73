// Gathered parameters kept across the micro-batches of a step (FSDPModule::set_reshard_after_forward
// and set_reshard_after_backward false on all but the last): bit for bit the training without them,
// with one all-gather per unit per step; a kept gather of a trainable unit is gathered again after
// the optimizer steps it (never stale), a frozen unit's survives the step; and the memory report
// counts what stays gathered (2 thread ranks).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "fsdp/memory.h"
#include "shard/testing.h"
#include "support/ranks.h"
#include "support/train_ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {

constexpr int kWorld = 2, kMicro = 4, kSteps = 3;
constexpr int64_t kGlobalBatch = 8;

testing::ShardedModel build(DeviceMesh& mesh) {
  testing::ShardedModelOptions o;
  o.net.in = 7, o.net.dim = 33, o.net.hidden = 65, o.net.out = 5, o.net.blocks = 3;
  o.net.device = at::kMeta;
  o.shard.init(init::normal(0.3, 5));
  o.adamw = AdamWOptions(1e-2).weight_decay(0.1);
  return testing::make_sharded_model(mesh, o);
}

double micro_step(testing::ShardedModel& j, int rank, int step, int m) {
  const int64_t local = kGlobalBatch / kWorld;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + 10 * step + m);
  const at::Tensor x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
  const at::Tensor loss =
      at::mse_loss(fsdp::call(j.model, x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local)) / kMicro;
  loss.backward();
  return loss.item<double>();
}

struct RunResult {
  std::vector<std::string> prints{kWorld};
  std::vector<std::vector<uint64_t>> gather_bytes{kWorld};         // per step
  std::vector<int64_t> kept_bytes = std::vector<int64_t>(kWorld);  // gathered bytes alive between micro-batches
};

RunResult train(bool keep) {
  RunResult r;
  r.prints = testing::train_ranks(
      kWorld,
      [&](DeviceMesh& mesh, int rank) {
        auto j = build(mesh);
        std::vector<double> losses;
        for (int s = 0; s < kSteps; ++s) {
          const CommStats before = mesh.shard_group().stats();
          for (int m = 0; m < kMicro; ++m) {
            const bool last = m == kMicro - 1;
            j.root->set_requires_gradient_sync(last);
            if (keep) {
              j.root->set_reshard_after_forward(false);
              j.root->set_reshard_after_backward(last);
            }
            losses.push_back(micro_step(j, rank, s, m));
            if (s == 1 && m == 0)
              r.kept_bytes[rank] =
                  memory_report(*j.root).unsharded_alive - memory_report(*j.root).unsharded_grads_alive;
          }
          r.gather_bytes[rank].push_back(
              (mesh.shard_group().stats() - before).of(CollectiveKind::kAllGather).bytes_sent);
          j.optim->step();
          j.optim->zero_grad();
        }
        return testing::state_bytes(losses, *j.root, j.optim.get());
      },
      std::chrono::seconds(120));
  return r;
}

TEST(KeptGathers, AcrossMicroBatchesTrainBitwiseWithOneGatherPerUnitPerStep) {
  const RunResult plain = train(false);
  const RunResult kept = train(true);
  EXPECT_EQ(kept.prints, plain.prints);  // the losses and every state, bit for bit
  for (int r = 0; r < kWorld; ++r) {
    // 4 units (3 blocks and the root): without keeping, the blocks but the last gather twice per
    // micro-batch and the last block and the root once; kept, each unit once per step.
    for (int s = 1; s < kSteps; ++s) {
      const uint64_t per_micro_plain = plain.gather_bytes[r][s] / kMicro;
      EXPECT_EQ(plain.gather_bytes[r][s] % kMicro, 0u);
      EXPECT_LT(kept.gather_bytes[r][s] * 3 / 2, per_micro_plain) << "rank " << r << " step " << s;
      EXPECT_GT(kept.gather_bytes[r][s], 0u) << "after a step every trainable unit is gathered again";
    }
    EXPECT_GT(kept.kept_bytes[r], 0);
    EXPECT_EQ(plain.kept_bytes[r], 0) << "nothing stays gathered between micro-batches without keeping";
  }
}

// A frozen unit's kept gather outlives the step (its values never change); a trainable unit's is
// gathered again after the optimizer stepped it.
TEST(KeptGathers, AFrozenUnitStaysGatheredAcrossStepsATrainableOneIsRegathered) {
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        testing::ShardedModelOptions o;
        o.net.blocks = 2;
        o.net.device = at::kMeta;
        o.shard.init(init::normal(0.3, 5));
        testing::Net net(o.net);
        for (auto& p : net->blocks[0]->parameters()) p.requires_grad_(false);
        auto j = testing::shard_model(std::move(net), mesh, o.shard, o.shard, o.adamw);
        j.root->set_reshard_after_forward(false);
        j.root->set_reshard_after_backward(false);
        auto units = fsdp::testing::units(*j.root);
        ShardedUnit* frozen = nullptr;
        for (auto* u : units) {
          bool any_grad = false;
          for (auto& fp : u->flat_params()) any_grad = any_grad || fp->config().requires_grad;
          if (!any_grad) frozen = u;
        }
        ASSERT_NE(frozen, nullptr);
        const at::Tensor x = at::ones({4, o.net.in}), y = at::zeros({4, o.net.out});
        for (int s = 0; s < 2; ++s) {
          const CommStats before = mesh.shard_group().stats();
          at::mse_loss(fsdp::call(j.model, x), y).backward();
          const uint64_t gathered = (mesh.shard_group().stats() - before).of(CollectiveKind::kAllGather).bytes_sent;
          EXPECT_TRUE(frozen->is_gathered_or_gathering()) << "step " << s;
          if (s == 1) {
            // The frozen block's params were not gathered again: only the trainable units' were.
            int64_t trainable_bytes = 0;
            for (auto* u : units) {
              if (u == frozen) continue;
              for (auto& fp : u->flat_params()) trainable_bytes += fp->shard_numel() * 4;
            }
            EXPECT_EQ(static_cast<int64_t>(gathered), trainable_bytes * (kWorld - 1));
          }
          j.optim->step();
          j.optim->zero_grad();
          // The step made every trainable unit's kept gather stale; the frozen one's stays current.
          for (auto* u : units) EXPECT_EQ(u->is_gathered_or_gathering(), u == frozen);
        }
      },
      std::chrono::seconds(60));
}

}  // namespace
}  // namespace fsdp
