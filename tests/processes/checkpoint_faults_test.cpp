// Checkpoint saves that cannot be written (process tier, 2 ranks): a disk that fills up on one rank
// (RLIMIT_FSIZE with SIGXFSZ ignored, so its writes fail with EFBIG as on a full disk) and a
// read-only checkpoint directory (a read-only bind mount in a private mount namespace when the
// test runs as root, who ignores permission bits; chmod 0555 otherwise). Each must give every rank
// the same clear error naming the failing rank and the cause, commit nothing, leave the earlier
// checkpoint byte for byte as it was (and `latest` on it, and loadable), and leave training able
// to go on: a step and a save elsewhere (or after the limit is lifted) succeed.
#include <signal.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {
using namespace std::chrono_literals;
using io::join;
using testing::Net;
using testing::NetOptions;
using testing::snapshot_files;

NetOptions big_net() {  // weights of 24 KiB, so files are far past the 16 KiB size limit below
  NetOptions o;
  o.in = 16, o.dim = 64, o.hidden = 96, o.out = 4, o.blocks = 2;
  return o;
}

using Trained = testing::ShardedModel;

Trained make(DeviceMesh& mesh) {
  testing::ShardedModelOptions o;
  o.net = big_net();
  o.shard.init(init::normal(0.1, 5));
  return testing::make_sharded_model(mesh, o);
}

void train_step(Trained& t, int s, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(10 * s + rank);
  auto x = at::randn({6, big_net().in}, gen), y = at::randn({6, big_net().out}, gen);
  testing::train_on_batch(t, x, y);
}

// Parent only: a committed step-00000001 under a fresh directory, saved by 2 thread-tier ranks.
std::string dir_with_one_checkpoint(const std::string& stem) {
  const std::string dir = testing::temp_path(stem);
  io::make_dirs(dir);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make(mesh);
    train_step(t, 0, dist->rank());
    checkpoint::TrainState st;
    st.step = 1;
    checkpoint::save(dir, "step-00000001", *t.root, t.optim.get(), st);
  });
  return dir;
}

// Where a fault test works: the parent makes a directory holding one committed checkpoint,
// records that checkpoint's files, and passes the directory to the rank processes in
// FSDP_FAULT_DIR.
struct FaultDir {
  bool child = false;
  std::string dir;
  std::map<std::string, std::string> before;  // parent only
};

FaultDir fault_dir(const std::string& stem) {
  FaultDir f;
  f.child = std::getenv("FSDP_TEST_CHILD") != nullptr;
  if (f.child) {
    f.dir = std::getenv("FSDP_FAULT_DIR");
    return f;
  }
  f.dir = dir_with_one_checkpoint(stem);
  f.before = snapshot_files(join(f.dir, "step-00000001"));
  ::setenv("FSDP_FAULT_DIR", f.dir.c_str(), 1);
  return f;
}

// The earlier checkpoint is unchanged, still `latest`, and loads.
void expect_earlier_intact(const std::string& dir, const std::map<std::string, std::string>& before,
                           const std::string& expected_latest = "step-00000001") {
  EXPECT_EQ(snapshot_files(join(dir, "step-00000001")), before);
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), join(dir, expected_latest));
  Net ref(big_net());
  EXPECT_NO_THROW(checkpoint::load_unsharded(join(dir, "step-00000001"), *ref));
}

void print_outcome(const std::vector<testing::RankResult>& results, const char* label) {
  for (const auto& r : results) {
    const auto at = r.output.find("save failed: ");
    std::printf("time-to-exit: %s: rank %d %.2f s%s%s\n", label, r.rank, r.seconds, at == std::string::npos ? "" : "; ",
                at == std::string::npos ? "" : r.output.substr(at, r.output.find('\n', at) - at).c_str());
  }
}

TEST(CheckpointFaults, DiskFullOnOneRankFailsEveryRankAndKeepsEarlierCheckpoints) {
  const FaultDir f = fault_dir("ckpt-diskfull");
  const std::string& dir = f.dir;
  const auto& before = f.before;
  auto results = testing::run_processes(2, [&](int rank) {
    auto dist = init_from_env(InitOptions().timeout(5s));
    DeviceMesh mesh(dist);
    auto t = make(mesh);
    train_step(t, 0, rank);
    rlimit old{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    if (rank == 1) {
      // No file of rank 1 may grow past 16 KiB: its shard writes fail with EFBIG, as on a full disk.
      ::signal(SIGXFSZ, SIG_IGN);
      rlimit small = old;
      small.rlim_cur = 16 << 10;
      ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0) << std::strerror(errno);
    }
    std::string error;
    try {
      checkpoint::save(dir, "step-00000002", *t.root, t.optim.get(), {});
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    if (rank == 1) ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
    std::printf("save failed: %s\n", error.c_str());
    EXPECT_NE(error.find("failed on rank 1 while writing its shards"), std::string::npos) << error;
    EXPECT_NE(error.find(std::strerror(EFBIG)), std::string::npos) << error;
    EXPECT_NE(error.find("nothing was committed"), std::string::npos) << error;
    // Training goes on, and the next save (space freed) commits.
    train_step(t, 1, rank);
    checkpoint::TrainState st;
    st.step = 3;
    checkpoint::save(dir, "step-00000003", *t.root, t.optim.get(), st);
  });
  testing::expect_all_ok(results);
  print_outcome(results, "disk full (RLIMIT_FSIZE) on rank 1 during save");
  // Never committed, and its NAME.tmp/ removed (Note [Orphaned saves]).
  EXPECT_FALSE(io::exists(join(dir, "step-00000002")));
  EXPECT_FALSE(io::exists(join(dir, "step-00000002.tmp")));
  expect_earlier_intact(dir, before, "step-00000003");
  io::remove_tree(dir);
}

// Makes `dir` read-only for this process, even for root: a read-only bind mount of it over itself
// in a mount namespace of this process alone (gone when it exits). Returns "" or why it could not.
std::string make_read_only(const std::string& dir) {
  if (::geteuid() != 0) return ::chmod(dir.c_str(), 0555) == 0 ? "" : std::strerror(errno);
  if (::unshare(CLONE_NEWNS) != 0) return std::string("unshare: ") + std::strerror(errno);
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
    return std::string("private: ") + std::strerror(errno);
  if (::mount(dir.c_str(), dir.c_str(), nullptr, MS_BIND, nullptr) != 0)
    return std::string("bind: ") + std::strerror(errno);
  if (::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) != 0) {
    return std::string("remount read-only: ") + std::strerror(errno);
  }
  return "";
}

TEST(CheckpointFaults, ReadOnlyDirectoryFailsEveryRankAndKeepsEarlierCheckpoints) {
  const FaultDir f = fault_dir("ckpt-readonly");
  const std::string& dir = f.dir;
  const auto& before = f.before;
  auto results = testing::run_processes(2, [&](int rank) {
    const std::string why = make_read_only(dir);
    ASSERT_EQ(why, "") << "cannot make " << dir << " read-only";
    {
      // The directory really is read-only to this process now.
      const std::string probe = join(dir, "probe");
      std::ofstream f(probe);
      ASSERT_FALSE(f.good() && (f << "x").good() && f.flush().good()) << dir << " is still writable";
    }
    auto dist = init_from_env(InitOptions().timeout(5s));
    DeviceMesh mesh(dist);
    auto t = make(mesh);
    train_step(t, 0, rank);
    std::string error;
    try {
      checkpoint::save(dir, "step-00000002", *t.root, t.optim.get(), {});
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    std::printf("save failed: %s\n", error.c_str());
    EXPECT_NE(error.find("failed on rank 0"), std::string::npos) << error;
    EXPECT_NE(error.find(dir), std::string::npos) << error;
    const bool names_cause =
        error.find(std::strerror(EROFS)) != std::string::npos || error.find(std::strerror(EACCES)) != std::string::npos;
    EXPECT_TRUE(names_cause) << error;
    EXPECT_NE(error.find("nothing was committed"), std::string::npos) << error;
    // Training goes on and saves elsewhere.
    train_step(t, 1, rank);
    checkpoint::save(dir + "-elsewhere", "step-00000002", *t.root, t.optim.get(), {});
  });
  if (!f.child && ::geteuid() != 0) ::chmod(dir.c_str(), 0755);
  testing::expect_all_ok(results);
  print_outcome(results, "read-only checkpoint directory");
  EXPECT_FALSE(io::exists(join(dir, "step-00000002")));
  EXPECT_FALSE(io::exists(join(dir, "step-00000002.tmp")));
  expect_earlier_intact(dir, before);
  EXPECT_TRUE(io::exists(join(join(dir + "-elsewhere", "step-00000002"), "train_state.json")));
  io::remove_tree(dir);
  io::remove_tree(dir + "-elsewhere");
}

}  // namespace
}  // namespace fsdp
