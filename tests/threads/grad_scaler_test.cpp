// GradScaler on 2 ranks: an inf injected into one rank's gradient shard skips the step on every
// rank (parameters untouched everywhere), the scale backs off and grows, loss scaling by a power
// of two leaves fp32 training bit for bit unchanged, fp16 overflow recovers by itself, and K
// skips in a row stop training with NonFiniteError on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <utility>

#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

std::mutex g_seed_mutex;  // at::manual_seed is process-global; ranks are threads

struct Rig {
  std::shared_ptr<Dist> dist;
  std::unique_ptr<DeviceMesh> mesh;
  testing::Net net{nullptr};
  std::shared_ptr<FSDPModule> root;
  std::unique_ptr<AdamW> optim;
  at::Tensor x, y;

  explicit Rig(std::shared_ptr<Dist> d, FullyShardOptions opts = {}) : dist(std::move(d)) {
    mesh = std::make_unique<DeviceMesh>(dist);
    {
      std::lock_guard<std::mutex> lock(g_seed_mutex);
      at::manual_seed(7);
      net = testing::Net(testing::NetOptions{});
    }
    for (auto& b : net->blocks) fully_shard(b, *mesh, opts);
    root = fully_shard(net, *mesh, opts);
    optim = std::make_unique<AdamW>(root, AdamWOptions(1e-2));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + dist->rank());  // each rank its own batch
    x = at::randn({6, 7}, gen);
    y = at::randn({6, 5}, gen);
  }
  at::Tensor loss() { return at::mse_loss(fsdp::call(net, x).to(at::kFloat), y); }
  // Every rank's master shards, concatenated.
  at::Tensor shards() {
    std::vector<at::Tensor> all;
    for (auto* fp : testing::flat_params(*root)) all.push_back(fp->sharded_param().clone());
    return at::cat(all);
  }
  // Collects the gradients, then puts `value` into one element of this rank's first gradient shard.
  void inject(double value) {
    for (auto* u : testing::units(*root)) u->collect_gradients();
    testing::flat_params(*root).front()->sharded_grad().view(-1)[0] = value;
  }
  // One step; `inject_rank` >= 0 puts an inf into that rank's gradient. Returns whether it stepped.
  bool step(GradScaler& scaler, int inject_rank = -1) {
    const auto l = loss();
    scaler.scale(l).backward();
    if (dist->rank() == inject_rank) inject(std::numeric_limits<double>::infinity());
    double norm = 0;
    if (!scaler.unscale_and_check(l)) norm = clip_grad_norm(*root, 1e9);
    const bool stepped = scaler.step(*optim, norm);
    optim->zero_grad();
    return stepped;
  }
};

TEST(GradScaler, InfOnOneRankSkipsTheStepOnEveryRank) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    Rig rig(dist);
    GradScaler scaler(rig.root, GradScalerOptions().init_scale(1024).growth_interval(2));
    EXPECT_TRUE(rig.step(scaler));
    const auto before = rig.shards();
    // Rank 1's shard holds the inf; rank 0's gradients are all finite, and it skips too.
    EXPECT_FALSE(rig.step(scaler, /*inject_rank=*/1));
    EXPECT_TRUE(at::equal(rig.shards(), before)) << "a skipped step changed rank " << dist->rank() << "'s params";
    EXPECT_EQ(scaler.current_scale(), 512);
    EXPECT_EQ(scaler.state().skipped_steps, 1);
    EXPECT_EQ(scaler.state().consecutive_skips, 1);
    // The optimizer's step count did not move either: the next good step is its second.
    for (auto& s : rig.optim->states()) EXPECT_EQ(s.step, 1) << s.tag;
    EXPECT_TRUE(rig.step(scaler));
    EXPECT_FALSE(at::equal(rig.shards(), before));
    EXPECT_EQ(scaler.state().consecutive_skips, 0);
    EXPECT_TRUE(rig.step(scaler));  // second good step in a row: the scale grows
    EXPECT_EQ(scaler.current_scale(), 1024);
  });
}

TEST(GradScaler, NanLossOnOneRankSkipsEverywhereWithScalingOff) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    Rig rig(dist);
    GradScaler scaler(rig.root, GradScalerOptions().enabled(false));
    EXPECT_EQ(scaler.current_scale(), 1);
    const auto before = rig.shards();
    auto l = rig.loss();
    if (dist->rank() == 0) l = l * std::numeric_limits<double>::quiet_NaN();
    scaler.scale(l).backward();
    EXPECT_TRUE(scaler.unscale_and_check(l));
    EXPECT_FALSE(scaler.step(*rig.optim));
    rig.optim->zero_grad();
    EXPECT_TRUE(at::equal(rig.shards(), before));
    EXPECT_EQ(scaler.current_scale(), 1);  // no scaling: nothing to back off
    EXPECT_TRUE(rig.step(scaler));
  });
}

// Scaling off and clipping on: the gradient pass is left to the clipping norm, which is inf on
// every rank when one rank's shard holds an inf, so every rank still skips the same step.
TEST(GradScaler, GradientsJudgedByTheClippingNormSkipEverywhere) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    Rig rig(dist);
    GradScaler scaler(rig.root, GradScalerOptions().enabled(false));
    const auto before = rig.shards();
    const auto l = rig.loss();
    scaler.scale(l).backward();
    if (dist->rank() == 1) rig.inject(std::numeric_limits<double>::infinity());
    EXPECT_FALSE(scaler.unscale_and_check(l, /*gradients_by_norm=*/true));  // the loss is finite
    const double norm = clip_grad_norm(*rig.root, 1.0);
    EXPECT_FALSE(std::isfinite(norm)) << "rank " << dist->rank();
    EXPECT_FALSE(scaler.step(*rig.optim, norm));
    rig.optim->zero_grad();
    EXPECT_TRUE(at::equal(rig.shards(), before)) << "a skipped step changed rank " << dist->rank() << "'s params";
    EXPECT_EQ(scaler.state().skipped_steps, 1);
  });
}

TEST(GradScaler, PowerOfTwoScalingLeavesFp32TrainingBitForBit) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    Rig scaled(dist), plain(dist);
    GradScaler on(scaled.root, GradScalerOptions().init_scale(65536).growth_interval(1));
    GradScaler off(plain.root, GradScalerOptions().enabled(false));
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(scaled.step(on));
      EXPECT_TRUE(plain.step(off));
    }
    EXPECT_EQ(on.current_scale(), 65536.0 * 8);
    EXPECT_TRUE(at::equal(scaled.shards(), plain.shards()));
  });
}

TEST(GradScaler, Fp16OverflowBacksOffUntilStepsSucceed) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    Rig rig(dist,
            FullyShardOptions().mp_policy(MixedPrecisionPolicy().param_dtype(at::kHalf).reduce_dtype(at::kFloat)));
    // 2^40 overflows fp16 (max 65504) in the first backward: the scale halves until it fits.
    GradScaler scaler(rig.root, GradScalerOptions().init_scale(std::ldexp(1.0, 40)).max_consecutive_skips(40));
    int skipped = 0, stepped = 0;
    for (int i = 0; i < 40 && stepped < 3; ++i) (rig.step(scaler) ? stepped : skipped)++;
    EXPECT_EQ(stepped, 3);
    EXPECT_GT(skipped, 10);
    EXPECT_EQ(scaler.state().skipped_steps, skipped);
    EXPECT_EQ(scaler.current_scale(), std::ldexp(1.0, 40 - skipped));
    EXPECT_TRUE(at::isfinite(rig.shards()).all().item<bool>());
  });
}

TEST(GradScaler, KSkipsInARowStopTrainingOnEveryRank) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    Rig rig(dist);
    GradScaler scaler(rig.root, GradScalerOptions().max_consecutive_skips(3));
    EXPECT_FALSE(rig.step(scaler, 0));
    EXPECT_TRUE(rig.step(scaler));  // a good step resets the run of skips
    EXPECT_FALSE(rig.step(scaler, 1));
    EXPECT_FALSE(rig.step(scaler, 0));
    try {
      rig.step(scaler, 1);
      ADD_FAILURE() << "rank " << dist->rank() << ": no NonFiniteError after 3 skips in a row";
    } catch (const NonFiniteError& e) {
      EXPECT_NE(std::string(e.what()).find("3 steps in a row"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("max_consecutive_skips=3"), std::string::npos) << e.what();
    }
    EXPECT_EQ(scaler.state().skipped_steps, 4);
  });
}

TEST(GradScaler, BadOptionsAreNamed) {
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  testing::Net net(testing::NetOptions{});
  auto root = fully_shard(net, mesh);
  EXPECT_THROW(GradScaler(nullptr), ConfigError);
  EXPECT_THROW(GradScaler(root, GradScalerOptions().backoff_factor(1.5)), ConfigError);
  EXPECT_THROW(GradScaler(root, GradScalerOptions().growth_factor(1.0)), ConfigError);
  EXPECT_THROW(GradScaler(root, GradScalerOptions().init_scale(0)), ConfigError);
  EXPECT_THROW(GradScaler(root, GradScalerOptions().growth_interval(0)), ConfigError);
  GradScaler ok(root);
  EXPECT_THROW(ok.load_state(GradScalerState{-1.0, 0, 0, 0}), ConfigError);
  ok.load_state(GradScalerState{8.0, 3, 2, 1});
  EXPECT_EQ(ok.current_scale(), 8.0);
}

}  // namespace
}  // namespace fsdp
