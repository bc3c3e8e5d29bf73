// Accumulation under hybrid sharding without the replicas' all-reduce on every micro-batch
// (FSDPModule::set_requires_all_reduce(false)): 4 thread ranks as 2 replicas of 2 shards (two
// simulated nodes). The gradient shards equal those of all-reducing every micro-batch to fp32
// rounding; the replicas' group carries one all-reduce per step instead of one per micro-batch
// while the shard group's traffic is unchanged; the partial sums are counted while they wait; and
// what would apply a gradient never all-reduced is a UsageError that says what to do.
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
#include "support/sharded_model.h"

namespace fsdp {
namespace {

constexpr int kWorld = 4, kReplicas = 2, kMicro = 4;
constexpr int64_t kGlobalBatch = 16;

testing::ShardedModel build(DeviceMesh& mesh) {
  testing::ShardedModelOptions o;
  o.net.in = 7, o.net.dim = 33, o.net.hidden = 65, o.net.out = 5, o.net.blocks = 3;
  o.net.device = at::kMeta;
  o.shard.strategy(ShardingStrategy::kHybridShard).init(init::normal(0.3, 5));
  return testing::make_sharded_model(mesh, o);
}

// The backward of kMicro micro-batches; `all_reduce_each`: the replicas' all-reduce on every one
// (else on the last only).
void accumulate(testing::ShardedModel& j, int rank, bool all_reduce_each, int step = 0) {
  const int64_t local = kGlobalBatch / kWorld;
  for (int m = 0; m < kMicro; ++m) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + 10 * step + m);
    const at::Tensor x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
    j.root->set_requires_all_reduce(all_reduce_each || m == kMicro - 1);
    const at::Tensor loss =
        at::mse_loss(fsdp::call(j.model, x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local)) / kMicro;
    loss.backward();
  }
}

at::Tensor grads_of(testing::ShardedModel& j) {
  std::vector<at::Tensor> parts;
  for (auto* unit : fsdp::testing::units(*j.root)) {
    for (auto& fp : unit->flat_params()) {
      fp->grads().finalize();
      parts.push_back(fp->sharded_grad().clone());
    }
  }
  return at::cat(parts);
}

struct Traffic {
  uint64_t shard_group = 0, replicas = 0;
};

Traffic traffic(DeviceMesh& mesh, const CommStats& shard0, const CommStats& rep0) {
  return {(mesh.shard_group().stats() - shard0).total_bytes_sent(),
          (mesh.replicate_group().stats() - rep0).total_bytes_sent()};
}

TEST(HsdpAccumulation, EqualsAllReducingEachMicroBatchWithOneAllReducePerStep) {
  std::vector<at::Tensor> each(kWorld), once(kWorld);
  std::vector<Traffic> t_each(kWorld), t_once(kWorld);
  std::vector<int64_t> partial_mid(kWorld), partial_end(kWorld), trainable_shard(kWorld);
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        const int rank = dist->rank();
        DeviceMesh mesh(dist, kReplicas, kWorld / kReplicas);
        for (bool all_reduce_each : {true, false}) {
          auto j = build(mesh);
          accumulate(j, rank, true);  // a first step, so lazy init and its collectives are behind
          j.optim->step();
          j.optim->zero_grad();
          const CommStats s0 = mesh.shard_group().stats(), r0 = mesh.replicate_group().stats();
          if (!all_reduce_each) {
            // After one micro-batch, the partial sums wait: one fp32 shard per trainable flat param.
            const int64_t local = kGlobalBatch / kWorld;
            auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + 10 + 0);
            const at::Tensor x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
            j.root->set_requires_all_reduce(false);
            (at::mse_loss(fsdp::call(j.model, x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local)) /
             kMicro)
                .backward();
            for (auto* unit : fsdp::testing::units(*j.root)) {
              for (auto& fp : unit->flat_params()) {
                fp->grads().finalize();
                if (fp->config().requires_grad) trainable_shard[rank] += fp->shard_numel();
              }
            }
            partial_mid[rank] = memory_report(*j.root).partial_grads;
            // Reading the gradient for a step now is refused: it was never all-reduced.
            try {
              j.optim->step();
              ADD_FAILURE() << "stepped on partial sums";
            } catch (const UsageError& e) {
              EXPECT_NE(std::string(e.what()).find("set_requires_all_reduce(true)"), std::string::npos) << e.what();
            }
            // The rest of the step's micro-batches (the first is in the sums already).
            for (int m = 1; m < kMicro; ++m) {
              auto g = at::make_generator<at::CPUGeneratorImpl>(100 + 10 + m);
              const at::Tensor xm = at::randn({kGlobalBatch, 7}, g), ym = at::randn({kGlobalBatch, 5}, g);
              j.root->set_requires_all_reduce(m == kMicro - 1);
              (at::mse_loss(fsdp::call(j.model, xm.narrow(0, rank * local, local)), ym.narrow(0, rank * local, local)) /
               kMicro)
                  .backward();
            }
          } else {
            accumulate(j, rank, true, 1);
          }
          (all_reduce_each ? each : once)[rank] = grads_of(j);
          (all_reduce_each ? t_each : t_once)[rank] = traffic(mesh, s0, r0);
          if (!all_reduce_each) partial_end[rank] = memory_report(*j.root).partial_grads;
          j.optim->step();  // the sums were all-reduced: the step takes them
          j.optim->zero_grad();
        }
      },
      std::chrono::seconds(120));
  for (int r = 0; r < kWorld; ++r) {
    // The same gradient, the sums associated differently: equal to fp32 rounding.
    const double scale = each[r].abs().max().item<double>();
    EXPECT_GT(scale, 0);
    EXPECT_LE((each[r] - once[r]).abs().max().item<double>(), 1e-6 * scale) << "rank " << r;
    // The shard group's reduce-scatters (and gathers) are the same; the replicas' all-reduce runs
    // once per step instead of once per micro-batch.
    EXPECT_EQ(t_once[r].shard_group, t_each[r].shard_group) << "rank " << r;
    EXPECT_GT(t_each[r].replicas, 0u);
    EXPECT_EQ(t_once[r].replicas * kMicro, t_each[r].replicas) << "rank " << r;
    EXPECT_EQ(partial_mid[r], 4 * trainable_shard[r]) << "rank " << r;
    EXPECT_EQ(partial_end[r], 0) << "rank " << r;
  }
}

TEST(HsdpAccumulation, WithTheStepInBackwardIsAUsageError) {
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist, kReplicas, kWorld / kReplicas);
        auto j = build(mesh);
        j.optim->step_in_backward(true);
        j.root->set_requires_all_reduce(false);
        const at::Tensor x = at::ones({kGlobalBatch / kWorld, 7}), y = at::zeros({kGlobalBatch / kWorld, 5});
        try {
          at::mse_loss(fsdp::call(j.model, x), y).backward();
          ADD_FAILURE() << "a backward stepped a gradient not all-reduced";
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("set_requires_all_reduce(false)"), std::string::npos) << e.what();
        }
      },
      std::chrono::seconds(60));
}

// Without replicas the option changes nothing: the reduce-scatter is the whole reduction.
TEST(HsdpAccumulation, WithoutReplicasChangesNothing) {
  std::vector<at::Tensor> on(2), off(2);
  testing::run_threads(
      2,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        for (bool all_reduce : {true, false}) {
          testing::ShardedModelOptions o;
          o.net.device = at::kMeta;
          o.shard.init(init::normal(0.3, 5));
          auto j = testing::make_sharded_model(mesh, o);
          j.root->set_requires_all_reduce(all_reduce);
          const at::Tensor x = at::ones({4, o.net.in}), y = at::zeros({4, o.net.out});
          at::mse_loss(fsdp::call(j.model, x), y).backward();
          EXPECT_EQ(memory_report(*j.root).partial_grads, 0);
          (all_reduce ? on : off)[dist->rank()] = grads_of(j);
        }
      },
      std::chrono::seconds(60));
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(at::equal(on[r], off[r]));
}

}  // namespace
}  // namespace fsdp
