// The CPU transport's hops: shared memory between ranks of one host, Gloo between hosts, both in
// one ring. Threads tier: every collective, over sizes (one element, uneven, several slots),
// dtypes and 2-4 ranks, is bitwise equal over shared memory, over Gloo and over a mix of the two
// (ranks given host ids), with the same byte counts. Processes tier (ShmProcesses.*): nothing is
// left in /dev/shm after a normal exit, an error or a SIGKILL, stale segments of dead processes
// are removed at start-up, and dead or stopped peers fail every survivor within the timeout.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>
#include <iostream>
#include <regex>
#include <set>

#include "comm/shm_channel.h"
#include "comm/transport.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

using namespace std::chrono_literals;

struct Layout {
  int world;
  std::vector<std::string> hosts;  // host id per rank; empty = detected (one host)
  const char* expected_backend;
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << l.world << " ranks on hosts";
  for (const auto& h : l.hosts) *os << ' ' << h;
}

std::unique_ptr<Transport> transport(const std::shared_ptr<Dist>& dist, const std::string& group,
                                     const std::string& mode, const std::string& host_id) {
  CpuTransportOptions options;
  options.timeout = 20s;
  options.hostname = "127.0.0.1";
  options.mode = mode;
  options.host_id = host_id;
  auto store = c10::make_intrusive<c10d::PrefixStore>("test/" + group, dist->store());
  return make_cpu_transport(store, dist->rank(), dist->world_size(), options);
}

at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype, int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7919 * seed + rank + 1);
  auto t = at::randn({n}, gen, at::TensorOptions().dtype(at::kDouble)) * 100;
  return at::isIntegralType(dtype, false) ? t.round().to(dtype) : t.to(dtype);
}

// Runs every collective on `t`, returning each result and the bytes the rings counted (broadcast
// and barrier are left out: over Gloo alone they are Gloo's own, counted by their algorithm).
std::vector<at::Tensor> run_all(Transport& t, int64_t n, at::ScalarType dtype, TransferCount& count) {
  const int rank = t.rank(), world = t.size();
  std::vector<at::Tensor> out;
  auto gathered = at::empty({n * world}, rank_input(0, 1, dtype, 0).options());
  t.all_gather(gathered, rank_input(rank, n, dtype, 1), count);
  out.push_back(gathered);
  const bool floating = at::isFloatingType(dtype);
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    if (op == ReduceOp::kAvg && !floating) continue;
    auto shard = at::empty({n}, gathered.options());
    t.reduce_scatter(shard, rank_input(rank, n * world, dtype, 2), op, count);
    out.push_back(shard);
    // All-reduce of a size that does not divide by the world (padded inside).
    auto whole = rank_input(rank, n * world + 1, dtype, 3);
    t.all_reduce(whole, op, count);
    out.push_back(whole);
  }
  auto b = rank == world - 1 ? rank_input(rank, n + 3, dtype, 4) : at::zeros({n + 3}, gathered.options());
  TransferCount uncounted;
  t.broadcast(b, world - 1, uncounted);
  out.push_back(b);
  t.barrier(uncounted);
  return out;
}

class ShmTransport : public ::testing::TestWithParam<Layout> {};

TEST_P(ShmTransport, BitwiseEqualToTheGlooRing) {
  const Layout layout = GetParam();
  // 131075 fp32 elements span two slots and a part; bf16 and fp16 fit more per slot.
  const std::vector<int64_t> sizes{1, 7, 131075};
  const std::vector<at::ScalarType> dtypes{at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong};
  testing::run_threads(
      layout.world,
      [&](const std::shared_ptr<Dist>& dist) {
        const std::string host = layout.hosts.empty() ? "" : layout.hosts[dist->rank()];
        auto gloo = transport(dist, "gloo", "gloo", host);
        auto shm = transport(dist, "shm", "auto", host);
        EXPECT_STREQ(gloo->backend_name(), "gloo");
        EXPECT_STREQ(shm->backend_name(), layout.expected_backend);
        for (auto dtype : dtypes) {
          for (int64_t n : sizes) {
            TransferCount cg, cs;
            auto a = run_all(*gloo, n, dtype, cg);
            auto b = run_all(*shm, n, dtype, cs);
            ASSERT_EQ(a.size(), b.size());
            for (size_t i = 0; i < a.size(); ++i) {
              EXPECT_TRUE(at::equal(a[i], b[i]))
                  << "result " << i << ", " << dtype << ", " << n << " elements, rank " << dist->rank();
            }
            EXPECT_EQ(cs.sent, cg.sent) << dtype << " " << n;
            EXPECT_EQ(cs.received, cg.received) << dtype << " " << n;
          }
        }
        // And against arithmetic done here: the sum of every rank's input.
        TransferCount c;
        auto x = rank_input(dist->rank(), 1000, at::kLong, 9);
        shm->all_reduce(x, ReduceOp::kSum, c);
        auto expected = at::zeros({1000}, at::kLong);
        for (int r = 0; r < layout.world; ++r) expected += rank_input(r, 1000, at::kLong, 9);
        EXPECT_TRUE(at::equal(x, expected));
      },
      120s);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShmTransport,
                         ::testing::Values(Layout{2, {}, "shm"}, Layout{3, {}, "shm"}, Layout{4, {}, "shm"},
                                           Layout{4, {"a", "a", "b", "b"}, "shm+gloo"},
                                           Layout{3, {"a", "a", "b"}, "shm+gloo"}, Layout{3, {"a", "b", "c"}, "gloo"}));

TEST(ShmTransportConfig, UnknownModeIsAConfigError) {
  testing::run_threads(1, [](const std::shared_ptr<Dist>& dist) {
    try {
      transport(dist, "bad", "infiniband", "");
      ADD_FAILURE() << "expected a ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("\"infiniband\""), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("FSDP_CPU_TRANSPORT"), std::string::npos) << e.what();
    }
  });
}

TEST(ShmTransportConfig, WorldGroupUsesSharedMemoryByDefault) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    // The world group of ranks on one host runs its collectives over shared memory.
    auto out = at::empty({4});
    dist->world().all_gather(out, at::full({2}, static_cast<float>(dist->rank())), "ag").wait();
    EXPECT_TRUE(at::equal(out, at::tensor({0.f, 0.f, 1.f, 1.f})));
    EXPECT_EQ(std::string(dist->world().backend_name()), "shm");
  });
}

// ---- processes tier ----

// The /dev/shm entries this library made for process `pid`.
std::vector<std::string> segments_of(pid_t pid) {
  std::vector<std::string> found;
  const std::string prefix = std::string(kShmSegmentPrefix) + std::to_string(pid) + "-";
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(dir)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) found.push_back(e->d_name);
    }
    ::closedir(dir);
  }
  return found;
}

std::set<pid_t> pids_in(const std::vector<testing::RankResult>& results) {
  std::set<pid_t> pids;
  static const std::regex re("rank pid (\\d+)");
  for (const auto& r : results) {
    for (std::sregex_iterator it(r.output.begin(), r.output.end(), re), end; it != end; ++it) {
      pids.insert(static_cast<pid_t>(std::stol((*it)[1])));
    }
  }
  return pids;
}

void expect_no_segments(const std::vector<testing::RankResult>& results, size_t ranks) {
  const auto pids = pids_in(results);
  EXPECT_EQ(pids.size(), ranks) << testing::describe(results);
  for (pid_t pid : pids) EXPECT_TRUE(segments_of(pid).empty()) << "pid " << pid << " left a segment";
}

std::shared_ptr<Dist> join_shm() {
  std::cout << "rank pid " << ::getpid() << std::endl;
  auto dist = init_from_env(InitOptions().timeout(3s).cpu_transport("auto"));
  EXPECT_EQ(std::string(dist->world().backend_name()), "shm");
  return dist;
}

TEST(ShmProcesses, NothingLeftAfterANormalExit) {
  auto results = testing::run_processes(3, [](int rank) {
    auto dist = join_shm();
    auto out = at::empty({3 * 300000});
    dist->world().all_gather(out, at::full({300000}, static_cast<float>(rank)), "ag").wait();
    for (int r = 0; r < 3; ++r) EXPECT_EQ(out[300000 * r + 5].item<float>(), r);
  });
  testing::expect_all_ok(results);
  expect_no_segments(results, 3);
}

TEST(ShmProcesses, NothingLeftAfterAnErrorOrASigkill) {
  auto results = testing::run_processes(3, [](int rank) {
    auto dist = join_shm();
    dist->world().barrier("warm-up");
    if (rank == 1) throw std::runtime_error("rank 1 fails on purpose");
    if (rank == 2) ::raise(SIGKILL);
    auto out = at::empty({3 * 1000});
    dist->world().all_gather(out, at::ones({1000}), "after").wait();
  });
  EXPECT_EQ(results[1].exit_code, 3) << testing::describe(results);
  EXPECT_EQ(results[2].term_signal, SIGKILL) << testing::describe(results);
  EXPECT_EQ(results[0].exit_code, 3) << testing::describe(results);
  EXPECT_NE(results[0].output.find("all_gather 'after'"), std::string::npos) << testing::describe(results);
  EXPECT_NE(results[0].output.find("peer rank"), std::string::npos) << testing::describe(results);
  expect_no_segments(results, 3);
}

TEST(ShmProcesses, StaleSegmentsOfDeadProcessesAreRemovedAtStartUp) {
  // A pid that no longer exists: a child that has exited and been reaped.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string stale = "/" + std::string(kShmSegmentPrefix) + std::to_string(child) + "-stale-r0";
  const std::string live = "/" + std::string(kShmSegmentPrefix) + std::to_string(::getpid()) + "-live-r0";
  for (const auto& name : {stale, live}) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name;
    ::close(fd);
  }
  auto results = testing::run_processes(2, [](int) {
    auto dist = join_shm();
    dist->world().barrier("b");
  });
  testing::expect_all_ok(results);
  EXPECT_TRUE(segments_of(child).empty()) << "the dead process's segment is still there";
  EXPECT_EQ(segments_of(::getpid()).size(), 1u) << "a live process's segment was removed";
  ::shm_unlink(live.c_str());
}

TEST(ShmProcesses, ASetUpFailureOnOneRankFallsBackToGlooOnEveryRank) {
  auto results = testing::run_processes(2, [](int rank) {
    if (rank == 1) {
      // No file may grow past 64 KiB here: creating a 2 MiB segment fails on this rank only.
      rlimit lim{64 << 10, 64 << 10};
      ::setrlimit(RLIMIT_FSIZE, &lim);
      ::signal(SIGXFSZ, SIG_IGN);
    }
    std::cout << "rank pid " << ::getpid() << std::endl;
    auto dist = init_from_env(InitOptions().timeout(3s));
    EXPECT_EQ(std::string(dist->world().backend_name()), "gloo");
    auto out = at::empty({4});
    dist->world().all_gather(out, at::full({2}, static_cast<float>(rank)), "ag").wait();
    EXPECT_TRUE(at::equal(out, at::tensor({0.f, 0.f, 1.f, 1.f})));
  });
  testing::expect_all_ok(results);
  for (const auto& r : results) {
    EXPECT_NE(r.output.find("go over Gloo instead"), std::string::npos) << testing::describe(results);
    EXPECT_NE(r.output.find("rank 1 could not create its segment"), std::string::npos) << testing::describe(results);
    EXPECT_NE(r.output.find("File too large"), std::string::npos) << testing::describe(results);
  }
  expect_no_segments(results, 2);
}

TEST(ShmProcesses, StoppedPeerFailsEveryOtherRankWithinTheTimeout) {
  testing::ProcessOptions opts;
  opts.may_hang = {2};
  auto results = testing::run_processes(
      3,
      [](int rank) {
        auto dist = join_shm();
        dist->world().barrier("warm-up");
        if (rank == 2) ::raise(SIGSTOP);
        auto in = at::ones({3 * 1000});
        auto out = at::empty({1000});
        dist->world().reduce_scatter(out, in, ReduceOp::kSum, "blocks.3/1").wait();
      },
      opts);
  for (int r : {0, 1}) {
    EXPECT_EQ(results[r].exit_code, 3) << testing::describe(results);
    EXPECT_FALSE(results[r].killed_by_parent) << testing::describe(results);
    EXPECT_LT(results[r].seconds, 3 + 10) << testing::describe(results);
    EXPECT_NE(results[r].output.find("reduce_scatter 'blocks.3/1'"), std::string::npos) << testing::describe(results);
  }
  EXPECT_NE(results[0].output.find("Timed out"), std::string::npos) << testing::describe(results);
  // Rank 0 waits for rank 2 itself; rank 1, which waits for rank 0, is told so: both point at 2.
  EXPECT_NE(results[0].output.find("peer rank 2"), std::string::npos) << testing::describe(results);
  EXPECT_NE(results[1].output.find("rank 2"), std::string::npos) << testing::describe(results);
  expect_no_segments(results, 3);
}

}  // namespace
}  // namespace fsdp
