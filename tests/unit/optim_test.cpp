// Optimizer options and the LR schedule: values and the errors that name bad settings.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "support/models.h"

namespace fsdp {
namespace {

TEST(Optim, WarmupCosineSchedule) {
  WarmupCosine s(1.0, 10, 110, 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);
  EXPECT_NEAR(s.lr_at(60), 0.55, 1e-12);  // half way: min + (max - min) / 2
  EXPECT_DOUBLE_EQ(s.lr_at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(500), 0.1);
  EXPECT_THROW(WarmupCosine(1.0, -1, 10), ConfigError);
}

TEST(Optim, BadOptionsAreNamed) {
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  testing::Net net(testing::NetOptions{});
  auto root = fully_shard(net, mesh);
  try {
    AdamW(root, AdamWOptions(-1));
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("learning rate: -1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(AdamW(root, AdamWOptions(1e-3).beta1(1.0)), ConfigError);
  EXPECT_THROW(SGD(root, SGDOptions(0.1).nesterov(true)), ConfigError);
  EXPECT_THROW(parse_strategy("ZERO4"), ConfigError);
  EXPECT_EQ(parse_strategy("shard_grad_op"), ShardingStrategy::kShardGradOp);
  EXPECT_THROW(fully_shard(net, mesh), ConfigError);  // twice on one module
  testing::Net other(testing::NetOptions{});
  EXPECT_THROW(fully_shard(other, mesh, FullyShardOptions().strategy(ShardingStrategy::kHybridShard)), ConfigError);
}

TEST(Optim, GroupOptionsScaleLearningRateAndDecay) {
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  testing::NetOptions o;
  o.blocks = 0;
  testing::Net net(o);
  auto root = fully_shard(net, mesh);
  SGD optim(root, SGDOptions(0.5).weight_decay(0.0));
  optim.set_group_options(1, GroupOptions().lr_scale(0.0));  // freeze biases through the LR
  auto before = net->inp->bias.detach().clone();
  auto wbefore = net->inp->weight.detach().clone();
  at::mse_loss(fsdp::call(net, at::randn({3, o.in})), at::randn({3, o.out})).backward();
  optim.step();
  EXPECT_TRUE(at::equal(net->inp->bias.detach(), before));
  EXPECT_FALSE(at::equal(net->inp->weight.detach(), wbefore));
}

}  // namespace
}  // namespace fsdp
