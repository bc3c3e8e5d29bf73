// Prefetching: results bitwise identical with prefetch off, on, deeper, explicit, under a changed
// execution order and with a unit skipped; the cap on gathered units holds; the trace has every
// span kind with the unit named.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <optional>
#include <tuple>

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

struct PrefetchRun {
  std::optional<int> depth;
  int cap = 0;
  bool explicit_lists = false;
  bool flip_order_on_odd_steps = false;
  int skip_block = -1;
  std::shared_ptr<Tracer> tracer;
};

struct Outcome {
  std::vector<at::Tensor> shards;
  std::vector<double> losses;
  int peak_units = 0;
};

Outcome train(const std::shared_ptr<Dist>& dist, const PrefetchRun& setup) {
  DeviceMesh mesh(dist);
  testing::NetOptions o;
  o.blocks = 5;
  o.skip_block = setup.skip_block;
  o.device = at::kMeta;
  testing::Net model(o);
  auto opts = FullyShardOptions().init(init::normal(0.3, 9)).prefetch_depth(setup.depth);
  std::vector<std::shared_ptr<FSDPModule>> units;
  for (auto& b : model->blocks) units.push_back(fully_shard(b, mesh, opts));
  auto root = fully_shard(model, mesh, FullyShardOptions(opts).max_unsharded_units(setup.cap));
  if (setup.explicit_lists) {
    for (size_t i = 0; i < units.size(); ++i) {
      if (i + 1 < units.size()) units[i]->set_modules_to_forward_prefetch({units[i + 1]});
      if (i > 0) units[i]->set_modules_to_backward_prefetch({units[i - 1]});
    }
  }
  if (setup.tracer) root->set_tracer(setup.tracer);
  AdamW optim(root, AdamWOptions(1e-2));
  Outcome out;
  for (int step = 0; step < 6; ++step) {
    model->opts.reverse_blocks = setup.flip_order_on_odd_steps && step % 2 == 1;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(step + 1);
    auto x = at::randn({8, o.in}, gen), y = at::randn({8, o.out}, gen);
    auto loss = at::mse_loss(fsdp::call(model, x.narrow(0, dist->rank() * 4, 4)), y.narrow(0, dist->rank() * 4, 4));
    loss.backward();
    optim.step();
    optim.zero_grad();
    out.losses.push_back(loss.item<double>());
  }
  for (const auto& unit : fsdp::testing::units(*root)) {
    for (auto& fp : unit->flat_params()) out.shards.push_back(fp->sharded_param().clone());
  }
  out.peak_units = fsdp::testing::unit(*root).root_state().peak_gathered_units;
  return out;
}

void expect_same(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.losses, b.losses);  // bitwise
  ASSERT_EQ(a.shards.size(), b.shards.size());
  for (size_t i = 0; i < a.shards.size(); ++i) EXPECT_TRUE(at::equal(a.shards[i], b.shards[i])) << "flat " << i;
}

void compare_with_off(const PrefetchRun& on) {
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    PrefetchRun off = on;
    off.depth = 0;
    off.explicit_lists = false;
    off.tracer = nullptr;
    expect_same(train(dist, off), train(dist, on));
  });
}

TEST(Prefetch, DepthOneIsBitwiseEqualToOff) { compare_with_off({1}); }
TEST(Prefetch, DepthThreeIsBitwiseEqualToOff) { compare_with_off({3}); }
TEST(Prefetch, ExplicitListsAreBitwiseEqualToOff) { compare_with_off({0, 0, true}); }
TEST(Prefetch, ChangedExecutionOrderStaysCorrect) {
  PrefetchRun s{2};
  s.flip_order_on_odd_steps = true;
  compare_with_off(s);
}
TEST(Prefetch, SkippedUnitStaysCorrect) {
  PrefetchRun s{2};
  s.skip_block = 2;
  compare_with_off(s);
}

TEST(Prefetch, CapOnGatheredUnitsHolds) {
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    PrefetchRun uncapped{3};
    PrefetchRun capped{3, 3};
    const auto free_run = train(dist, uncapped);
    const auto capped_run = train(dist, capped);
    EXPECT_GT(free_run.peak_units, 3);  // deep prefetch does gather more without a cap
    EXPECT_LE(capped_run.peak_units, 3);
    expect_same(free_run, capped_run);
  });
}

// Note [The last unit keeps its params]: from the second step the block that ran forward last is
// not resharded after forward (one all-gather fewer per step), only while gradients are on, and
// not when reshard_after_forward is set explicitly; the results do not change.
TEST(Prefetch, LastUnitKeepsItsParamsForBackward) {
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    auto run = [&](std::optional<bool> reshard) {
      DeviceMesh mesh(dist);
      testing::NetOptions o;
      o.blocks = 3;
      o.device = at::kMeta;
      testing::Net model(o);
      auto opts = FullyShardOptions().init(init::normal(0.3, 9)).reshard_after_forward(reshard);
      std::vector<std::shared_ptr<FSDPModule>> blocks;
      for (auto& b : model->blocks) blocks.push_back(fully_shard(b, mesh, opts));
      auto root = fully_shard(model, mesh, FullyShardOptions().init(init::normal(0.3, 9)));
      AdamW optim(root, AdamWOptions(1e-2));
      auto& last = fsdp::testing::unit(*blocks.back());
      std::vector<double> losses;
      std::vector<uint64_t> gathered;
      for (int step = 0; step < 3; ++step) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(step + 1);
        auto x = at::randn({4, o.in}, gen), y = at::randn({4, o.out}, gen);
        const auto before = dist->world().stats();
        auto loss = at::mse_loss(fsdp::call(model, x), y);
        const bool kept = last.flat_params()[0]->state() == ShardedState::kUnsharded;
        EXPECT_EQ(kept, !reshard.has_value() && step > 0) << "step " << step;
        EXPECT_EQ(fsdp::testing::unit(*blocks[0]).flat_params()[0]->state(), ShardedState::kSharded);
        loss.backward();
        EXPECT_EQ(last.flat_params()[0]->state(), ShardedState::kSharded) << "freed by the end of backward";
        optim.step();
        optim.zero_grad();
        gathered.push_back((dist->world().stats() - before).of(CollectiveKind::kAllGather).bytes_sent);
        losses.push_back(loss.item<double>());
      }
      {
        c10::NoGradGuard no_grad;  // no backward coming: the last block frees its params as usual
        fsdp::call(model, at::randn({4, o.in}));
        EXPECT_EQ(last.flat_params()[0]->state(), ShardedState::kSharded);
      }
      int64_t last_bytes = 0;
      for (auto& fp : last.flat_params()) last_bytes += fp->padded_numel() * 4 / 2;  // (N-1)/N of it sent
      return std::make_tuple(losses, gathered, last_bytes);
    };
    const auto [kept_losses, kept_bytes, last_bytes] = run(std::nullopt);
    const auto [plain_losses, plain_bytes, unused] = run(true);
    EXPECT_EQ(kept_losses, plain_losses);  // bitwise
    EXPECT_EQ(kept_bytes[0], plain_bytes[0]);
    for (int step = 1; step < 3; ++step) {
      EXPECT_EQ(kept_bytes[step] + static_cast<uint64_t>(last_bytes), plain_bytes[step]) << "step " << step;
    }
  });
}

TEST(Prefetch, ExplicitUnshardHandle) {
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    testing::Net model(testing::NetOptions{});
    auto block = fully_shard(model->blocks[0], mesh);
    auto root = fully_shard(model, mesh);
    fsdp::testing::units(*root);
    EXPECT_FALSE(fsdp::testing::unit(*block).is_gathered_or_gathering());
    auto handle = block->unshard(/*async=*/true);
    EXPECT_TRUE(fsdp::testing::unit(*block).is_gathered_or_gathering());
    handle->wait();
    EXPECT_EQ(fsdp::testing::unit(*block).flat_params()[0]->state(), ShardedState::kUnsharded);
    block->reshard();
    EXPECT_FALSE(fsdp::testing::unit(*block).is_gathered_or_gathering());
  });
}

TEST(Prefetch, TraceHasEverySpanWithTheUnit) {
  const std::string path = testing::temp_path("trace") + ".json";
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    auto tracer = std::make_shared<Tracer>(dist->rank());
    PrefetchRun s{1};
    s.tracer = tracer;
    train(dist, s);
    if (dist->rank() == 0) tracer->write(path);
  });
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in);
  std::map<std::string, int> count;
  bool unit_named = false;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    count[e.at("name")]++;
    if (e.at("name") == "fsdp::all_gather" && e.at("args").at("unit").get<std::string>().rfind("blocks_", 0) == 0)
      unit_named = true;
  }
  for (const char* name : {"fsdp::forward", "fsdp::backward", "fsdp::all_gather", "fsdp::all_gather_wait",
                           "fsdp::reduce_scatter", "fsdp::optimizer_step"}) {
    EXPECT_GT(count[name], 0) << name;
  }
  EXPECT_TRUE(unit_named);
}

}  // namespace
}  // namespace fsdp
