// Launch-environment parsing and rendezvous errors: every bad or partial environment names its
// variable at once; a port in use and a rank that never joins fail within the timeout. A failing
// rank's error file for torchrun (write_launcher_error).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/file_io.h"
#include "base/host_malloc.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/launcher_error.h"
#include "support/ranks.h"

namespace fsdp {
namespace {
using Vars = std::map<std::string, std::string>;
using Clock = std::chrono::steady_clock;

DistEnv parse(const Vars& vars) {
  return parse_dist_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// Asserts parse throws EnvError whose message contains `needle`.
void expect_env_error(const Vars& vars, const std::string& needle) {
  try {
    parse(vars);
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const EnvError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

const Vars kTorchrun = {{"RANK", "1"},
                        {"WORLD_SIZE", "4"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "10.0.0.1"},
                        {"MASTER_PORT", "29500"}};

Vars with(Vars v, const std::string& k, const std::string& val) {
  v[k] = val;
  return v;
}
Vars without(Vars v, const std::string& k) {
  v.erase(k);
  return v;
}

// Rank `rank` of a `world`-rank job whose store is on 127.0.0.1:`port`.
DistEnv local_env(int rank, int world, int port) {
  DistEnv env;
  env.rank = rank;
  env.world_size = world;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  return env;
}

// Joins the two-rank group `env` describes and checks that an all-reduce sums both ranks.
void expect_two_ranks_sum(const DistEnv& env) {
  auto dist = init_process_group(env, InitOptions().timeout(std::chrono::seconds(10)));
  auto t = at::full({4}, 1.0f + env.rank);
  dist->world().all_reduce(t, ReduceOp::kSum, "x").wait();
  EXPECT_TRUE(at::equal(t, at::full({4}, 3.0f))) << "rank " << env.rank;
}

TEST(Env, NoVariablesMeansOneProcess) {
  auto env = parse({});
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.launcher, "none");
}

TEST(Env, Torchrun) {
  auto env = parse(kTorchrun);
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(Env, Slurm) {
  auto env = parse({{"SLURM_PROCID", "3"},
                    {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "1"},
                    {"MASTER_ADDR", "node1"},
                    {"MASTER_PORT", "1234"}});
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  expect_env_error({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"MASTER_PORT", "1"}}, "MASTER_ADDR");
  expect_env_error({{"SLURM_PROCID", "8"}, {"SLURM_NTASKS", "8"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}},
                   "SLURM_PROCID=8");
}

TEST(Env, OpenMpi) {
  auto env = parse({{"OMPI_COMM_WORLD_RANK", "2"},
                    {"OMPI_COMM_WORLD_SIZE", "3"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                    {"MASTER_ADDR", "h"},
                    {"MASTER_PORT", "99"}});
  EXPECT_EQ(env.launcher, "openmpi");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  expect_env_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT");
  expect_env_error({{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_SIZE");
}

// Hydra's mpiexec (MPICH, Intel MPI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
const Vars kHydra = {{"PMI_RANK", "2"},        {"PMI_SIZE", "4"},           {"MPI_LOCALRANKID", "0"},
                     {"MPI_LOCALNRANKS", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}};

TEST(Env, MpichAndIntelMpi) {
  auto env = parse(kHydra);
  EXPECT_EQ(env.launcher, "mpich");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  env = parse(without(without(kHydra, "MPI_LOCALRANKID"), "MPI_LOCALNRANKS"));  // PMI_* alone: one host
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 4);
  env = parse({{"PMI_RANK", "0"}, {"PMI_SIZE", "1"}});  // one process needs no master
  EXPECT_EQ(env.launcher, "mpich");
  EXPECT_EQ(env.world_size, 1);
  expect_env_error(without(kHydra, "MASTER_ADDR"), "MASTER_ADDR is not set (MPICH / Intel MPI launch");
  expect_env_error(without(kHydra, "MASTER_PORT"), "-genv");
  expect_env_error(without(kHydra, "PMI_SIZE"), "PMI_SIZE is not set");
  expect_env_error(without(kHydra, "PMI_RANK"), "PMI_RANK is not set");
  expect_env_error(with(kHydra, "PMI_RANK", "4"), "PMI_RANK=4 must be less than PMI_SIZE=4");
  expect_env_error(with(kHydra, "PMI_SIZE", "0"), "PMI_SIZE=0 is out of range");
  expect_env_error(with(kHydra, "MPI_LOCALRANKID", "x"), "MPI_LOCALRANKID='x' is not an integer");
  expect_env_error(with(kHydra, "MPI_LOCALRANKID", "2"), "local rank 2 must be less than the local world size 2");
  expect_env_error(with(kHydra, "MPI_LOCALNRANKS", "0"), "MPI_LOCALNRANKS=0 is out of range");
}

TEST(Env, MpichUnderSlurm) {
  // mpiexec in a batch script: every rank inherits the script's SLURM_PROCID=0; Hydra's variables win.
  auto env = parse(with(with(with(kHydra, "SLURM_PROCID", "0"), "SLURM_NTASKS", "8"), "SLURM_LOCALID", "0"));
  EXPECT_EQ(env.launcher, "mpich");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  // srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE but not MPI_LOCALRANKID: Slurm's own variables,
  // with the local rank (SLURM_LOCALID), are read.
  env = parse({{"PMI_RANK", "3"},
               {"PMI_SIZE", "8"},
               {"SLURM_PROCID", "3"},
               {"SLURM_NTASKS", "8"},
               {"SLURM_LOCALID", "1"},
               {"MASTER_ADDR", "h"},
               {"MASTER_PORT", "1"}});
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_rank, 1);
  // OpenMPI's variables come first.
  EXPECT_EQ(parse(with(with(kHydra, "OMPI_COMM_WORLD_RANK", "0"), "OMPI_COMM_WORLD_SIZE", "1")).launcher, "openmpi");
}

// A temporary folder, removed with what is in it; TORCHELASTIC_ERROR_FILE unset before and after.
class LauncherError : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fsdp-launcher-error-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ::unsetenv("TORCHELASTIC_ERROR_FILE");
  }
  void TearDown() override {
    ::unsetenv("TORCHELASTIC_ERROR_FILE");
    std::remove(file().c_str());
    ::rmdir(dir_.c_str());
  }
  std::string file() const { return dir_ + "/error.json"; }
  std::string dir_;
};

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST_F(LauncherError, WritesTorchrunsFormatOnce) {
  const std::runtime_error first("fsdp: config: unknown key \"model.bogus\"\nsecond line \xff");
  ASSERT_EQ(::setenv("TORCHELASTIC_ERROR_FILE", file().c_str(), 1), 0);
  const auto t0 = static_cast<int64_t>(std::time(nullptr));
  EXPECT_TRUE(write_launcher_error(first));
  const auto t1 = static_cast<int64_t>(std::time(nullptr));
  const std::string text = read_all(file());
  const auto j = nlohmann::json::parse(text);  // valid JSON, invalid UTF-8 replaced
  const std::string expected = "fsdp: config: unknown key \"model.bogus\"\nsecond line \xef\xbf\xbd";
  EXPECT_EQ(j.at("message").at("message").get<std::string>(), expected) << text;
  EXPECT_EQ(j.at("message").at("extraInfo").at("py_callstack").get<std::string>(), expected) << text;
  // torchrun's ProcessFailure reads int(message["extraInfo"]["timestamp"]): seconds, as a string.
  const std::string ts = j.at("message").at("extraInfo").at("timestamp").get<std::string>();
  EXPECT_GE(std::stoll(ts), t0);
  EXPECT_LE(std::stoll(ts), t1);
  // A later error leaves the first one, the root cause, in place.
  EXPECT_FALSE(write_launcher_error(std::runtime_error("a later error")));
  EXPECT_EQ(read_all(file()), text);
}

TEST_F(LauncherError, NothingWithoutAFileAndNeverThrows) {
  const std::runtime_error e("boom");
  EXPECT_FALSE(write_launcher_error(e));                     // unset: not under torchrun
  ASSERT_EQ(::setenv("TORCHELASTIC_ERROR_FILE", "", 1), 0);  // torchrun without a log folder
  EXPECT_FALSE(write_launcher_error(e));
  ASSERT_EQ(::setenv("TORCHELASTIC_ERROR_FILE", (dir_ + "/missing/error.json").c_str(), 1), 0);
  EXPECT_FALSE(write_launcher_error(e));  // cannot be created: skipped, no exception
  EXPECT_FALSE(io::exists(file()));
}

TEST(Env, LaunchersStoreHints) {
  // torchrun's agent store: every rank a client, keys per restart.
  auto env = parse(with(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "True"), "TORCHELASTIC_RESTART_COUNT", "2"));
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.restart_count, 2);
  EXPECT_FALSE(parse(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "False")).agent_store);
  expect_env_error(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "yes"), "TORCHELASTIC_USE_AGENT_STORE='yes'");
  expect_env_error(with(with(kTorchrun, "TORCHELASTIC_USE_AGENT_STORE", "True"), "TORCHELASTIC_RESTART_COUNT", "x"),
                   "TORCHELASTIC_RESTART_COUNT='x'");
  // The launcher's socket: rank 0 only (another rank ignores it).
  auto rank0 = with(with(kTorchrun, "RANK", "0"), "LOCAL_RANK", "0");
  EXPECT_EQ(parse(with(rank0, "FSDP_MASTER_LISTEN_FD", "7")).master_listen_fd, 7);
  EXPECT_EQ(parse(rank0).master_listen_fd, -1);
  EXPECT_EQ(parse(with(kTorchrun, "FSDP_MASTER_LISTEN_FD", "7")).master_listen_fd, -1);
  expect_env_error(with(rank0, "FSDP_MASTER_LISTEN_FD", "seven"), "FSDP_MASTER_LISTEN_FD='seven'");
}

TEST(Env, TorchrunPrecedesOtherLaunchers) {
  auto env = parse(with(with(kTorchrun, "SLURM_PROCID", "0"), "SLURM_NTASKS", "1"));
  EXPECT_EQ(env.launcher, "torchrun");
}

TEST(Env, EveryBadVariableIsNamed) {
  const auto t0 = Clock::now();
  expect_env_error(without(kTorchrun, "MASTER_ADDR"), "MASTER_ADDR is not set");
  expect_env_error(without(kTorchrun, "MASTER_PORT"), "MASTER_PORT is not set");
  expect_env_error(without(kTorchrun, "RANK"), "RANK is not set");
  expect_env_error(without(kTorchrun, "WORLD_SIZE"), "WORLD_SIZE is not set");
  expect_env_error(with(kTorchrun, "RANK", "abc"), "RANK='abc' is not an integer");
  expect_env_error(with(kTorchrun, "RANK", "1x"), "RANK='1x' is not an integer");
  expect_env_error(with(kTorchrun, "RANK", ""), "RANK is set but empty");
  expect_env_error(with(kTorchrun, "RANK", "4"), "RANK=4 must be less than WORLD_SIZE=4");
  expect_env_error(with(kTorchrun, "RANK", "-1"), "RANK=-1 is out of range");
  expect_env_error(with(kTorchrun, "WORLD_SIZE", "0"), "WORLD_SIZE=0 is out of range");
  expect_env_error(with(kTorchrun, "WORLD_SIZE", "99999999999999"), "WORLD_SIZE=99999999999999 is out of range");
  expect_env_error(with(kTorchrun, "MASTER_PORT", "70000"), "MASTER_PORT=70000 is out of range");
  expect_env_error(with(kTorchrun, "MASTER_PORT", "http"), "MASTER_PORT='http' is not an integer");
  expect_env_error(with(kTorchrun, "LOCAL_RANK", "x"), "LOCAL_RANK='x'");
  expect_env_error(with(kTorchrun, "LOCAL_RANK", "2"), "local rank 2 must be less than");
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
}

TEST(Env, SingleRankTorchrunNeedsNoMaster) {
  auto env = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(env.world_size, 1);
  auto dist = init_process_group(env);
  EXPECT_EQ(dist->world().size(), 1);
  auto t = at::ones({3});
  auto out = at::empty({3});
  dist->world().all_gather(out, t, "x").wait();
  EXPECT_TRUE(at::equal(out, t));
}

TEST(Rendezvous, PortInUseFailsWithAMessage) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const DistEnv env = local_env(0, 2, ntohs(addr.sin_port));
  const auto t0 = Clock::now();
  try {
    init_process_group(env, InitOptions().timeout(std::chrono::seconds(3)));
    ADD_FAILURE() << "rank 0 started a store on a port in use";
  } catch (const DistError& e) {
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(env.master_port)), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 3.0 + 2.0);
  ::close(fd);
}

// What fsdp-run does: rank 0 hosts the store on the socket it was handed, never on a port that
// was closed and could have been taken; a socket on another port is refused by name.
TEST(Rendezvous, RankZeroHostsTheStoreOnTheSocketItIsHanded) {
  testing::HeldPort held;
  const int port = held.port();
  const int fd = held.release();  // rank 0's store owns it from here
  auto run = [&](int rank) {
    DistEnv env = local_env(rank, 2, port);
    if (rank == 0) env.master_listen_fd = fd;
    expect_two_ranks_sum(env);
  };
  std::thread zero(run, 0);
  run(1);
  zero.join();

  testing::HeldPort other;
  DistEnv bad = local_env(0, 2, port);
  bad.master_listen_fd = other.fd();
  try {
    init_process_group(bad, InitOptions().timeout(std::chrono::seconds(2)));
    ADD_FAILURE() << "hosted the store on a socket bound to another port";
  } catch (const EnvError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_MASTER_LISTEN_FD=" + std::to_string(other.fd()) +
                                         " is not a TCP socket bound to MASTER_PORT=" + std::to_string(port)),
              std::string::npos)
        << e.what();
  }
}

// torchrun's agent store: the agent hosts it, every rank (rank 0 too) joins as a client, and the
// keys a failed attempt left behind do not reach the next one.
TEST(Rendezvous, AgentStoreIsJoinedByEveryRankPerRestart) {
  testing::HeldPort held;
  c10d::TCPStoreOptions sopts;
  sopts.port = static_cast<uint16_t>(held.port());
  sopts.isServer = true;
  sopts.waitWorkers = false;
  sopts.masterListenFd = held.release();
  c10d::TCPStore agent("127.0.0.1", sopts);
  // What a first attempt of a two-rank job leaves: both joined, and Gloo addresses that lead nowhere.
  for (const char* key : {"fsdp/attempt/0/fsdp/joined/0", "fsdp/attempt/0/fsdp/joined/1"}) {
    agent.set(key, std::vector<uint8_t>{1});
  }
  auto run = [&](int rank) {
    DistEnv env = local_env(rank, 2, sopts.port);
    env.agent_store = true;
    env.restart_count = 1;
    expect_two_ranks_sum(env);
  };
  std::thread zero(run, 0);
  run(1);
  zero.join();
  EXPECT_TRUE(agent.check({"fsdp/attempt/1/fsdp/joined/0"}));
  EXPECT_TRUE(agent.check({"fsdp/attempt/1/fsdp/joined/1"}));
}

// Note [A group is ready when every member is]: ranks that make the world and drop it at once,
// using it for nothing, must not fail a peer that is still connecting. Many small worlds, so a
// slow rank among quick ones is all but certain on a loaded machine.
TEST(Rendezvous, WorldsMadeAndDroppedAtOnceFailNoPeer) {
  for (int i = 0; i < 60; ++i) testing::run_threads(4, [](const std::shared_ptr<Dist>&) {});
}

TEST(Rendezvous, RankThatNeverJoinsIsNamedWithinTheTimeout) {
  testing::HeldPort held;
  DistEnv env = local_env(0, 3, held.port());
  env.master_listen_fd = held.release();  // the store owns it from here
  const auto t0 = Clock::now();
  try {
    init_process_group(env, InitOptions().timeout(std::chrono::seconds(2)));
    ADD_FAILURE() << "rendezvous succeeded with ranks missing";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 1, 2 of 3 never joined"), std::string::npos) << e.what();
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(s, 1.9);
  EXPECT_LT(s, 2.0 + 3.0);
}

TEST(Rendezvous, UnreachableStoreFailsWithinTheTimeout) {
  testing::HeldPort bound_only(/*listening=*/false);  // taken for the test, and nobody listens
  const DistEnv env = local_env(1, 2, bound_only.port());
  const auto t0 = Clock::now();
  try {
    init_process_group(env, InitOptions().timeout(std::chrono::seconds(2)));
    ADD_FAILURE() << "rank 1 joined without a store";
  } catch (const DistError& e) {
    EXPECT_NE(std::string(e.what()).find("could not reach the rendezvous store"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0 + 5.0);
}

}  // namespace
}  // namespace fsdp

// Note [Host malloc settings]: applied once per process unless the user chose malloc settings.
TEST(HostMalloc, TunedOnceUnlessTheUserChoseSettings) {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const char* opt = std::getenv("FSDP_HOST_MALLOC_TUNING");
  const bool user_chose = (tunables != nullptr && std::string(tunables).find("malloc") != std::string::npos) ||
                          std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
                          std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
                          (opt != nullptr && std::string(opt) == "0");
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
  EXPECT_EQ(fsdp::base::tune_host_malloc(), !user_chose);
  EXPECT_EQ(fsdp::base::tune_host_malloc(), !user_chose);  // idempotent
#else
  // Without glibc's malloc (AddressSanitizer's allocator replaces it, and its mallopt does nothing
  // and returns 0) there is nothing to tune, and the call says so.
  (void)user_chose;
  EXPECT_FALSE(fsdp::base::tune_host_malloc());
#endif
}
