// Process tier: each rank is a re-executed copy of this binary. A killed or stopped peer must make
// every surviving rank fail within the timeout with an error naming the collective, its tag and,
// when known, the peer.
#include <signal.h>

#include <cstdio>
#include <functional>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "support/ranks.h"

namespace fsdp {
namespace {
using namespace std::chrono_literals;
using testing::RankResult;

constexpr auto kTimeout = 3s;

// Every case runs over both CPU transports: shared memory between the ranks (this host's default)
// and Gloo (what ranks on different hosts use).
class ProcessTier : public ::testing::TestWithParam<std::string> {
 protected:
  std::shared_ptr<Dist> join() const {
    auto dist = init_from_env(InitOptions().timeout(kTimeout).cpu_transport(GetParam()));
    EXPECT_EQ(std::string(dist->world().backend_name()), GetParam() == "auto" ? "shm" : "gloo");
    return dist;
  }
};

// Runs `collective`, printing the type of the error it throws: a transport's failure must reach the
// calling thread as fsdp::DistError, a timeout as fsdp::TimeoutError (never an abort, never another
// type).
void typed(const std::function<void()>& collective) {
  try {
    collective();
  } catch (const TimeoutError& e) {
    std::fprintf(stderr, "caught fsdp::TimeoutError\n");
    throw;
  } catch (const DistError& e) {
    std::fprintf(stderr, "caught fsdp::DistError\n");
    throw;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "caught another exception type\n");
    throw;
  }
}

void expect_survivors_fail(const std::vector<RankResult>& results, int victim, const std::string& needle) {
  for (const auto& r : results) {
    if (r.rank == victim) continue;
    EXPECT_EQ(r.exit_code, 3) << testing::describe(results);
    EXPECT_FALSE(r.killed_by_parent) << "rank " << r.rank << " hung\n" << testing::describe(results);
    EXPECT_LT(r.seconds, std::chrono::duration<double>(kTimeout).count() + 10) << testing::describe(results);
    EXPECT_NE(r.output.find(needle), std::string::npos) << testing::describe(results);
  }
}

TEST_P(ProcessTier, HealthyRanksAllGather) {
  auto results = testing::run_processes(3, [this](int rank) {
    auto dist = join();
    auto out = at::empty({6});
    dist->world().all_gather(out, at::full({2}, static_cast<float>(rank)), "ok").wait();
    for (int r = 0; r < 3; ++r) EXPECT_EQ(out[2 * r].item<float>(), r);
  });
  testing::expect_all_ok(results);
}

TEST_P(ProcessTier, PeerKilledDuringAllGather) {
  auto results = testing::run_processes(3, [this](int rank) {
    auto dist = join();
    dist->world().barrier("warm-up");
    if (rank == 2) ::raise(SIGKILL);
    auto out = at::empty({3 * 100000});
    typed([&] { dist->world().all_gather(out, at::ones({100000}), "layers.0").wait(); });
  });
  EXPECT_EQ(results[2].term_signal, SIGKILL);
  expect_survivors_fail(results, 2, "all_gather 'layers.0'");
  expect_survivors_fail(results, 2, "caught fsdp::DistError");
}

TEST_P(ProcessTier, PeerKilledDuringReduceScatter) {
  auto results = testing::run_processes(2, [this](int rank) {
    auto dist = join();
    auto in = at::ones({2 * 4000000});
    auto out = at::empty({4000000});
    dist->world().reduce_scatter(out, in, ReduceOp::kSum, "grads").wait();
    if (rank == 0) ::raise(SIGKILL);
    dist->world().reduce_scatter(out, at::ones({2 * 4000000}), ReduceOp::kSum, "grads.2").wait();
  });
  EXPECT_EQ(results[0].term_signal, SIGKILL);
  expect_survivors_fail(results, 0, "reduce_scatter 'grads.2'");
  EXPECT_NE(results[1].output.find("peer rank 0"), std::string::npos) << testing::describe(results);
}

TEST_P(ProcessTier, StoppedPeerTimesOut) {
  testing::ProcessOptions opts;
  opts.may_hang = {1};
  auto results = testing::run_processes(
      3,
      [this](int rank) {
        auto dist = join();
        dist->world().barrier("warm-up");
        if (rank == 1) ::raise(SIGSTOP);
        auto out = at::empty({3 * 1000});
        typed([&] { dist->world().all_gather(out, at::ones({1000}), "stopped").wait(); });
      },
      opts);
  expect_survivors_fail(results, 1, "all_gather 'stopped'");
  // The stopped rank's neighbours time out; the third may instead see its neighbour give up.
  int timeouts = 0;
  for (const auto& r : results) timeouts += r.output.find("caught fsdp::TimeoutError") != std::string::npos;
  EXPECT_GE(timeouts, 1) << testing::describe(results);
  for (const auto& r : results) {
    EXPECT_EQ(r.output.find("caught another exception type"), std::string::npos) << testing::describe(results);
  }
}

TEST_P(ProcessTier, FailureBreaksTheCommunicator) {
  auto results = testing::run_processes(2, [this](int rank) {
    auto dist = join();
    if (rank == 1) ::raise(SIGKILL);
    auto out = at::empty({2});
    auto h1 = dist->world().all_gather(out, at::ones({1}), "first");
    auto h2 = dist->world().all_gather(out, at::ones({1}), "second");
    try {
      h1.wait();
    } catch (const DistError&) {
    }
    h2.wait();  // must fail fast, naming the earlier failure
  });
  expect_survivors_fail(results, 1, "unusable after an earlier failure");
}

INSTANTIATE_TEST_SUITE_P(Transports, ProcessTier, ::testing::Values("auto", "gloo"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "auto" ? std::string("SharedMemory") : std::string("Gloo");
                         });

}  // namespace
}  // namespace fsdp
