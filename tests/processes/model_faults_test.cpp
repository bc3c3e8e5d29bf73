// Process tier, peer faults while a fully_shard'ed model trains or saves: a rank SIGKILLed inside
// a forward (the others are in a unit's all-gather), inside backward before its unit's
// reduce-scatter, during a checkpoint save; a rank SIGSTOPped mid-step; a rank whose backward
// throws; rank 0 (the store host) dying during the rendezvous and mid-training; a rank that never
// joins. Every surviving rank must exit non-zero within timeout + 10 s with a message naming the
// collective (and the peer when known). Each case prints its survivors' time to exit
// ("time-to-exit: ...") for docs/NOTES.md.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "base/file_io.h"
#include "checkpoint/save_job.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"

namespace fsdp {
namespace {
using namespace std::chrono_literals;
using testing::RankResult;

constexpr auto kTimeout = 3s;
constexpr double kTimeoutS = 3.0;

constexpr int64_t kIn = 16, kDim = 64, kHidden = 96, kOut = 4;

// A small net like testing::Net whose forward can kill its process right after a given block (a
// forward tripwire: LibTorch modules have no forward hooks to do it from outside).
class TripNetImpl : public torch::nn::Module {
 public:
  TripNetImpl() {
    inp = register_module("inp", testing::Dense(kIn, kDim));
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(register_module("blocks_" + std::to_string(i), testing::Block(kDim, kHidden)));
    }
    head = register_module("head", testing::Dense(kDim, kOut));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(inp->forward(x));
    for (size_t i = 0; i < blocks.size(); ++i) {
      h = fsdp::call(blocks[i], h);
      if (static_cast<int>(i) == kill_after_block) ::raise(SIGKILL);
    }
    return head->forward(h);
  }
  int kill_after_block = -1;
  testing::Dense inp{nullptr}, head{nullptr};
  std::vector<testing::Block> blocks;
};
TORCH_MODULE(TripNet);

using Model = testing::BasicShardedModel<TripNet>;

Model make_model(DeviceMesh& mesh, std::optional<int> prefetch = std::nullopt) {
  auto opts = FullyShardOptions().init(init::normal(0.1, 7)).prefetch_depth(prefetch);
  return testing::shard_model(TripNet(), mesh, opts, opts, AdamWOptions(1e-3));
}

// One training step on a per-rank batch.
void step(Model& m, int s, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s * 7 + rank);
  auto x = at::randn({8, kIn}, gen), y = at::randn({8, kOut}, gen);
  testing::train_on_batch(m, x, y);
}

std::shared_ptr<Dist> join() { return init_from_env(InitOptions().timeout(kTimeout)); }

// Survivors: exit code 3 (threw), not hung, within timeout + 10 s, each needle in the output.
void expect_survivors_fail(const std::vector<RankResult>& results, const std::vector<int>& victims,
                           const std::vector<std::string>& needles, const std::string& label) {
  std::string times;
  for (const auto& r : results) {
    if (std::find(victims.begin(), victims.end(), r.rank) != victims.end()) continue;
    EXPECT_EQ(r.exit_code, 3) << testing::describe(results);
    EXPECT_FALSE(r.killed_by_parent) << "rank " << r.rank << " hung\n" << testing::describe(results);
    EXPECT_LT(r.seconds, kTimeoutS + 10) << testing::describe(results);
    for (const auto& n : needles) {
      EXPECT_NE(r.output.find(n), std::string::npos) << "rank " << r.rank << " does not say '" << n << "'\n"
                                                     << testing::describe(results);
    }
    char buf[64];
    std::snprintf(buf, sizeof(buf), " rank %d %.2f s", r.rank, r.seconds);
    times += buf;
  }
  // The figures for the note; the first line of a survivor's error shows what it reported.
  std::printf("time-to-exit: %s (timeout %.0f s):%s\n", label.c_str(), kTimeoutS, times.c_str());
  for (const auto& r : results) {
    const auto at = r.output.find("threw: ");
    if (at != std::string::npos) {
      std::printf("  rank %d: %s\n", r.rank, r.output.substr(at, r.output.find('\n', at) - at).c_str());
    }
  }
}

TEST(ModelFaults, PeerKilledDuringForwardAllGather) {
  // Rank 2 dies between blocks 0 and 1 of step 1's forward: the others are gathering a block.
  auto results = testing::run_processes(3, [](int rank) {
    auto dist = join();
    DeviceMesh mesh(dist);
    auto m = make_model(mesh);
    step(m, 0, rank);
    if (rank == 2) m.model->kill_after_block = 0;
    step(m, 1, rank);
  });
  EXPECT_EQ(results[2].term_signal, SIGKILL) << testing::describe(results);
  expect_survivors_fail(results, {2}, {"all_gather 'blocks_"}, "SIGKILL during forward all-gather, 3 ranks");
  for (int r : {0, 1}) EXPECT_NE(results[r].output.find("peer rank"), std::string::npos) << testing::describe(results);
}

TEST(ModelFaults, PeerKilledDuringBackwardReduceScatter) {
  // Rank 1 dies in block 2's backward, after its all-gather and before its reduce-scatter: rank 0's
  // reduce-scatter of block 2's gradients has no partner.
  auto results = testing::run_processes(2, [](int rank) {
    auto dist = join();
    DeviceMesh mesh(dist);
    auto m = make_model(mesh, /*prefetch=*/0);
    step(m, 0, rank);
    if (rank == 1) {
      m.model->blocks[2]->fc1->weight.register_hook([](const at::Tensor& g) -> at::Tensor {
        ::raise(SIGKILL);
        return g;
      });
    }
    step(m, 1, rank);
  });
  EXPECT_EQ(results[1].term_signal, SIGKILL) << testing::describe(results);
  expect_survivors_fail(results, {1}, {"reduce_scatter 'blocks_2/", "peer rank 1"},
                        "SIGKILL during backward reduce-scatter, 2 ranks");
}

TEST(ModelFaults, RankThrowingInsideBackward) {
  auto results = testing::run_processes(2, [](int rank) {
    auto dist = join();
    DeviceMesh mesh(dist);
    auto m = make_model(mesh, /*prefetch=*/0);
    step(m, 0, rank);
    if (rank == 1) {
      m.model->blocks[1]->fc2->weight.register_hook([](const at::Tensor& g) -> at::Tensor {
        throw std::runtime_error("injected failure in block 1's backward");
      });
    }
    step(m, 1, rank);
  });
  EXPECT_EQ(results[1].exit_code, 3) << testing::describe(results);
  EXPECT_NE(results[1].output.find("injected failure in block 1's backward"), std::string::npos)
      << testing::describe(results);
  expect_survivors_fail(results, {1}, {"fsdp: ", "'blocks_", "peer rank 1"}, "rank 1 throws inside backward, 2 ranks");
}

TEST(ModelFaults, PeerStoppedMidStep) {
  testing::ProcessOptions opts;
  opts.may_hang = {1};
  auto results = testing::run_processes(
      2,
      [](int rank) {
        auto dist = join();
        DeviceMesh mesh(dist);
        auto m = make_model(mesh);
        step(m, 0, rank);
        if (rank == 1) ::raise(SIGSTOP);
        step(m, 1, rank);
      },
      opts);
  EXPECT_TRUE(results[1].killed_by_parent) << testing::describe(results);
  expect_survivors_fail(results, {1}, {"all_gather '", "peer rank 1"}, "SIGSTOP mid-step, 2 ranks");
  // Gloo's "Timed out waiting ..." or the transport's own "did not complete within": both correct.
  EXPECT_TRUE(results[0].output.find("Timed out") != std::string::npos ||
              results[0].output.find("did not complete within") != std::string::npos)
      << testing::describe(results);
}

TEST(ModelFaults, PeerKilledDuringCheckpointSave) {
  const bool child = std::getenv("FSDP_TEST_CHILD") != nullptr;
  const std::string dir = child ? std::getenv("FSDP_FAULT_DIR") : testing::temp_path("fault-save");
  if (!child) {
    io::make_dirs(dir);
    ::setenv("FSDP_FAULT_DIR", dir.c_str(), 1);
  }
  auto results = testing::run_processes(2, [&](int rank) {
    checkpoint::set_fault_hook_for_testing([](const std::string& phase, int r) {
      if (phase == "write" && r == 1) ::raise(SIGKILL);
    });
    auto dist = join();
    DeviceMesh mesh(dist);
    auto m = make_model(mesh);
    step(m, 0, rank);
    checkpoint::save(dir, "step-00000001", *m.root, m.optim.get(), {});
  });
  EXPECT_EQ(results[1].term_signal, SIGKILL) << testing::describe(results);
  // The save's agreement is a Gloo all-reduce, which does not say which peer went away; in a group
  // of two the communicator names the other rank.
  expect_survivors_fail(results, {1},
                        {"all_reduce 'checkpoint/writing its shards'", "group 'side/checkpoint'", "peer rank 1"},
                        "SIGKILL during checkpoint save, 2 ranks");
  EXPECT_FALSE(io::exists(io::join(dir, "step-00000001")));
  EXPECT_THROW(checkpoint::resolve(dir, "latest"), CheckpointError);
  io::remove_tree(dir);
}

TEST(ModelFaults, StoreHostDiesDuringRendezvous) {
  // Rank 0 hosts the store and dies while rank 1 waits in the join check for rank 2, which never
  // comes: rank 1 must fail at once on the lost store, not wait out the timeout.
  testing::ProcessOptions opts;
  auto results = testing::run_processes(
      3,
      [](int rank) {
        if (rank == 2) return;  // never joins
        if (rank == 0) {
          std::thread([] {
            std::this_thread::sleep_for(800ms);
            ::raise(SIGKILL);
          }).detach();
        }
        auto dist = init_from_env(InitOptions().timeout(6s));  // longer than rank 0's life
        ADD_FAILURE() << "rendezvous completed without rank 2";
      },
      opts);
  EXPECT_EQ(results[0].term_signal, SIGKILL) << testing::describe(results);
  EXPECT_EQ(results[1].exit_code, 3) << testing::describe(results);
  EXPECT_FALSE(results[1].killed_by_parent) << testing::describe(results);
  EXPECT_LT(results[1].seconds, 6.0 + 10) << testing::describe(results);
  EXPECT_NE(results[1].output.find("rendezvous"), std::string::npos) << testing::describe(results);
  std::printf("time-to-exit: store host dies during rendezvous (timeout 6 s): rank 1 %.2f s\n", results[1].seconds);
  const auto at = results[1].output.find("threw: ");
  if (at != std::string::npos) std::printf("  rank 1: %s\n", results[1].output.substr(at, 300).c_str());
}

TEST(ModelFaults, StoreHostDiesMidTraining) {
  auto results = testing::run_processes(2, [](int rank) {
    auto dist = join();
    DeviceMesh mesh(dist);
    auto m = make_model(mesh);
    step(m, 0, rank);
    step(m, 1, rank);
    if (rank == 0) ::raise(SIGKILL);
    step(m, 2, rank);
  });
  EXPECT_EQ(results[0].term_signal, SIGKILL) << testing::describe(results);
  expect_survivors_fail(results, {0}, {"all_gather '", "peer rank 0"},
                        "store host (rank 0) killed mid-training, 2 ranks");
}

TEST(ModelFaults, RankThatNeverJoins) {
  auto results = testing::run_processes(3, [](int rank) {
    if (rank == 1) return;  // started, never joins
    join();
  });
  EXPECT_EQ(results[1].exit_code, 0);
  expect_survivors_fail(results, {1}, {"rank 1 of 3 never joined"}, "a rank never joins, 3 ranks");
}

}  // namespace
}  // namespace fsdp
