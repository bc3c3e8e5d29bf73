// The collective-order check (InitOptions::check_collectives / FSDP_CHECK_COLLECTIVES=1; Note
// [Collective-order check] in src/comm/communicator.cpp): a rank that reorders two collectives, one
// that skips a collective, one that skips the last collective, and a sharded model whose ranks run
// their units in different orders are each reported as a mismatch naming the rank and the tag (the
// unit) within the timeout, instead of hanging or pairing bytes of different collectives. With the
// check on, a healthy run is unchanged.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"

namespace fsdp {
namespace {
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = 2s;

// Ranks as threads over a FileStore with the order check on; returns each rank's error ("" = none)
// and the seconds it took.
struct Outcome {
  std::vector<std::string> errors;
  std::vector<double> seconds;
};

Outcome run_checked(int world, const std::function<void(const std::shared_ptr<Dist>&)>& fn) {
  const std::string path = testing::temp_path("order-store");
  Outcome out;
  out.errors.resize(world);
  out.seconds.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const auto t0 = Clock::now();
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, world);
        auto dist = Dist::from_store(store, r, world, InitOptions().timeout(kTimeout).check_collectives(true));
        fn(dist);
      } catch (const std::exception& e) {
        out.errors[r] = e.what();
      }
      out.seconds[r] = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  ::unlink(path.c_str());
  return out;
}

void expect_has(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "missing '" << needle << "' in: " << text;
}

TEST(CollectiveOrder, HealthyCollectivesPassTheCheck) {
  auto out = run_checked(3, [](const std::shared_ptr<Dist>& dist) {
    auto& g = dist->world();
    auto full = at::empty({3 * 5});
    g.all_gather(full, at::full({5}, static_cast<float>(dist->rank())), "a").wait();
    for (int r = 0; r < 3; ++r) EXPECT_EQ(full[5 * r].item<float>(), r);
    auto t = at::ones({4});
    g.all_reduce(t, ReduceOp::kSum, "sum").wait();
    EXPECT_EQ(t[0].item<float>(), 3);
    auto shard = at::empty({2});
    g.reduce_scatter(shard, at::ones({6}), ReduceOp::kSum, "rs").wait();
    EXPECT_EQ(shard[1].item<float>(), 3);
    g.barrier("end");
    // The fingerprint exchange is not counted as traffic.
    EXPECT_EQ(g.stats().of(CollectiveKind::kAllGather).calls, 1u);
  });
  for (const auto& e : out.errors) EXPECT_EQ(e, "");
}

TEST(CollectiveOrder, ReorderedCollectivesAreAMismatchNamingRankAndTag) {
  auto out = run_checked(2, [](const std::shared_ptr<Dist>& dist) {
    auto& g = dist->world();
    auto a = at::empty({2 * 8}), b = at::empty({2 * 8});
    if (dist->rank() == 1) {
      auto hb = g.all_gather(b, at::ones({8}), "layers.1");
      auto ha = g.all_gather(a, at::ones({8}), "layers.0");
      hb.wait();
      ha.wait();
    } else {
      auto ha = g.all_gather(a, at::ones({8}), "layers.0");
      auto hb = g.all_gather(b, at::ones({8}), "layers.1");
      ha.wait();
      hb.wait();
    }
  });
  for (int r = 0; r < 2; ++r) {
    expect_has(out.errors[r], "collective-order mismatch on group 'world' at collective #0");
    expect_has(out.errors[r], "rank 0 issued all_gather 'layers.0' (32 bytes of Float)");
    expect_has(out.errors[r], "rank 1 issued all_gather 'layers.1'");
    EXPECT_LT(out.seconds[r], 2.0 + 10);
  }
}

TEST(CollectiveOrder, SkippedCollectiveIsAMismatch) {
  // Rank 2 skips the all-gather of 'blocks.0' and goes on with the reduce-scatter of 'blocks.1'.
  auto out = run_checked(3, [](const std::shared_ptr<Dist>& dist) {
    auto& g = dist->world();
    auto full = at::empty({3 * 4});
    g.all_gather(full, at::ones({4}), "warm-up").wait();
    if (dist->rank() != 2) g.all_gather(full, at::ones({4}), "blocks.0").wait();
    auto shard = at::empty({4});
    g.reduce_scatter(shard, at::ones({12}), ReduceOp::kAvg, "blocks.1").wait();
  });
  for (int r = 0; r < 3; ++r) {
    expect_has(out.errors[r], "at collective #1: ranks 0, 1 issued all_gather 'blocks.0' (16 bytes of Float)");
    expect_has(out.errors[r], "rank 2 issued reduce_scatter 'blocks.1' (48 bytes of Float)");
  }
}

TEST(CollectiveOrder, SkippedLastCollectiveNamesTheRankThatNeverReachedIt) {
  // Rank 1 skips the last collective and stays alive: rank 0 waits in the fingerprint exchange
  // until the timeout, and its error says where rank 1 is.
  std::atomic<bool> rank0_done{false};
  auto out = run_checked(2, [&](const std::shared_ptr<Dist>& dist) {
    auto& g = dist->world();
    auto full = at::empty({2 * 4});
    g.all_gather(full, at::ones({4}), "embed").wait();
    if (dist->rank() == 1) {
      while (!rank0_done) std::this_thread::sleep_for(10ms);
      return;
    }
    try {
      g.all_gather(full, at::ones({4}), "head").wait();
    } catch (...) {
      rank0_done = true;
      throw;
    }
    rank0_done = true;
  });
  expect_has(out.errors[0],
             "collective-order check: all_gather 'head' on rank 0 of 2 (group 'world') as collective #1");
  expect_has(out.errors[0], "rank 1 never reached collective #1; rank 1 is at collective #0: all_gather 'embed'");
  EXPECT_EQ(out.errors[1], "");
  EXPECT_LT(out.seconds[0], 2.0 + 10);
  std::printf("time-to-exit: rank 1 skips the last collective (order check, timeout 2 s): rank 0 %.2f s\n",
              out.seconds[0]);
}

// Blocks run in another order on rank 1: with FSDP_CHECK_COLLECTIVES=1, the first unit all-gather
// that differs is a mismatch naming both units, on every rank, well within the timeout.
TEST(CollectiveOrder, ShardedModelWithUnitsInAnotherOrderOnOneRank) {
  testing::ProcessOptions opts;
  opts.extra_env = {{"FSDP_CHECK_COLLECTIVES", "1"}};
  opts.timeout = 30s;
  auto results = testing::run_processes(
      2,
      [](int rank) {
        auto dist = init_from_env(InitOptions().timeout(3s));
        DeviceMesh mesh(dist);
        testing::NetOptions o;
        o.reverse_blocks = rank == 1;
        testing::Net net(o);
        auto opts = FullyShardOptions().init(init::normal(0.1, 1)).prefetch_depth(0);
        for (auto& b : net->blocks) fully_shard(b, mesh, opts);
        auto root = fully_shard(net, mesh, opts);
        auto x = at::randn({4, o.in}), y = at::randn({4, o.out});
        at::mse_loss(fsdp::call(net, x), y).backward();
      },
      opts);
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 3) << testing::describe(results);
    EXPECT_LT(r.seconds, 3.0 + 10) << testing::describe(results);
    expect_has(r.output, "collective-order mismatch on group 'world'");
    expect_has(r.output, "rank 0 issued all_gather 'blocks_0/");
    expect_has(r.output, "rank 1 issued all_gather 'blocks_2/");
    std::printf("time-to-exit: units in another order on rank 1 (order check, timeout 3 s): rank %d %.2f s\n", r.rank,
                r.seconds);
  }
}

// The same model and order on every rank trains with the check on, and its parameters are those of
// a run without it.
TEST(CollectiveOrder, CheckChangesNothingInAHealthyRun) {
  std::vector<at::Tensor> shards[2][2];  // [check][rank], units in order
  for (bool check : {true, false}) {
    const std::string path = testing::temp_path("order-healthy");
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
        auto dist = Dist::from_store(store, r, 2, InitOptions().timeout(5s).check_collectives(check));
        DeviceMesh mesh(dist);
        testing::ShardedModelOptions o;
        o.net.device = at::kMeta;  // materialised by the seeded init: the same on every run
        o.shard.init(init::normal(0.1, 1));
        auto m = testing::make_sharded_model(mesh, o);
        for (int s = 0; s < 3; ++s) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(s * 2 + r);
          auto x = at::randn({4, o.net.in}, gen), y = at::randn({4, o.net.out}, gen);
          testing::train_on_batch(m, x, y);
        }
        for (const auto& unit : fsdp::testing::units(*m.root)) {
          for (auto& fp : unit->flat_params()) shards[check][r].push_back(fp->sharded_param().clone());
        }
      });
    }
    for (auto& t : threads) t.join();
    ::unlink(path.c_str());
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(shards[1][r].size(), shards[0][r].size());
    ASSERT_FALSE(shards[1][r].empty());
    for (size_t i = 0; i < shards[1][r].size(); ++i) {
      EXPECT_TRUE(at::equal(shards[1][r][i], shards[0][r][i]))
          << "rank " << r << " flat param " << i << ": largest difference "
          << (shards[1][r][i] - shards[0][r][i]).abs().max().item<double>();
    }
  }
}

}  // namespace
}  // namespace fsdp
