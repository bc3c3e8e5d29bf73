// Optimizer options and the LR schedule: values and the errors that name bad settings; the
// stochastic rounding of AdamW's bf16 moments.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "fsdp/fsdp.h"
#include "optim/bf16_round.h"
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

// Rounding is unbiased: a value between two bf16 neighbours rounds up with probability equal to
// its place between them, so the mean over many elements is the value.
TEST(Bf16Round, IsUnbiasedAndOnlyEverPicksANeighbour) {
  const int64_t n = 1 << 16;
  auto from_bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  };
  for (float x : {1.0f + 0.3f / 128, -3.1415926f, 1e-20f, 7.77e30f, 0.999f * 0.001f}) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const float toward_zero = from_bits(bits & 0xffff0000u), away = from_bits((bits & 0xffff0000u) + 0x10000u);
    const at::Tensor src = at::full({n}, x);
    const at::Tensor dst = at::empty({n}, at::kBFloat16);
    round_to_bf16_stochastic(src, dst, 12345, 0);
    const at::Tensor wide = dst.to(at::kFloat);
    EXPECT_TRUE(at::logical_or(wide == toward_zero, wide == away).all().item<bool>()) << x;
    const double mean = wide.to(at::kDouble).mean().item<double>();
    const double ulp = std::abs(static_cast<double>(away) - toward_zero);
    EXPECT_NEAR(mean, x, 0.02 * ulp) << x;  // the mean of 65536 draws: within 2% of a last place
  }
}

TEST(Bf16Round, IsReproducibleChunkIndependentAndEqualOnBothPaths) {
  const at::Tensor src = at::randn({10007}) * 3;
  src[5] = std::numeric_limits<float>::quiet_NaN();
  src[6] = std::numeric_limits<float>::infinity();
  src[7] = -std::numeric_limits<float>::infinity();
  src[8] = -0.0f;
  src[9] = std::numeric_limits<float>::denorm_min();
  src[10] = -std::numeric_limits<float>::max();
  const at::Tensor a = at::empty({10007}, at::kBFloat16), b = at::empty_like(a), c = at::empty_like(a);
  round_to_bf16_stochastic(src, a, 99, 1000);
  round_to_bf16_stochastic(src, b, 99, 1000);
  EXPECT_TRUE(at::equal(a.view(at::kShort), b.view(at::kShort)));
  // In two chunks, each told where it starts.
  round_to_bf16_stochastic(src.narrow(0, 0, 4000), c.narrow(0, 0, 4000), 99, 1000);
  round_to_bf16_stochastic(src.narrow(0, 4000, 6007), c.narrow(0, 4000, 6007), 99, 5000);
  EXPECT_TRUE(at::equal(a.view(at::kShort), c.view(at::kShort)));
  // The ATen-operations path (what a device tensor takes) gives the same bits.
  const at::Tensor d = at::empty_like(a);
  testing::round_to_bf16_stochastic_ops(src, d, 99, 1000);
  EXPECT_TRUE(at::equal(a.view(at::kShort), d.view(at::kShort)));
  EXPECT_TRUE(std::isnan(a[5].item<float>()));
  EXPECT_EQ(a[6].item<float>(), std::numeric_limits<float>::infinity());
  EXPECT_EQ(a[7].item<float>(), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(a[8].item<float>(), 0.0f);
  // Another seed rounds some elements the other way.
  round_to_bf16_stochastic(src, b, 100, 1000);
  EXPECT_FALSE(at::equal(a.view(at::kShort), b.view(at::kShort)));
}

// Why the rounding is stochastic: after the gradient stops, exp_avg_sq decays by beta2 = 0.999 a
// step. Rounded to nearest, v * 0.999 rounds back to v in bf16 and the moment would never decay;
// rounded stochastically it follows the fp32 state's decay.
TEST(Bf16Round, SecondMomentDecaysAsInFp32) {
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  testing::NetOptions o;
  o.blocks = 0;
  std::vector<at::Tensor> v;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(0);
    testing::Net net(o);
    auto root = fully_shard(net, mesh);
    AdamW optim(root, AdamWOptions(1e-3).beta2(0.999).weight_decay(0).state_dtype(dtype));
    at::manual_seed(1);
    const at::Tensor x = at::randn({4, o.in}), y = at::randn({4, o.out});
    for (int s = 0; s < 700; ++s) {
      const at::Tensor out = fsdp::call(net, x);
      // One step with a gradient, then none: the moments only decay.
      (s == 0 ? at::mse_loss(out, y) : (out * 0).sum()).backward();
      optim.step();
      optim.zero_grad();
    }
    at::Tensor all;
    for (const auto& st : optim.states()) {
      const at::Tensor t = st.tensors.at("exp_avg_sq").to(at::kFloat);
      all = all.defined() ? at::cat({all, t}) : t;
    }
    v.push_back(all);
  }
  const at::Tensor live = v[0] > 1e-12;
  ASSERT_GT(live.sum().item<int64_t>(), 10);
  // 0.999^699 = 0.497 of the first step's value: the bf16 moments are within 5% of it in the mean.
  const double ratio = (v[1].masked_select(live) / v[0].masked_select(live)).mean().item<double>();
  EXPECT_NEAR(ratio, 1.0, 0.05);
}

TEST(Optim, StateDtypeIsFloatOrBFloat16) {
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  testing::Net net(testing::NetOptions{});
  auto root = fully_shard(net, mesh);
  try {
    AdamW(root, AdamWOptions(1e-3).state_dtype(at::kHalf));
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("state_dtype"), std::string::npos) << e.what();
  }
  AdamW ok(root, AdamWOptions(1e-3).state_dtype(at::kBFloat16));
  EXPECT_EQ(ok.state_dtype(), at::kBFloat16);
}

}  // namespace
}  // namespace fsdp
