// Sharded checkpoints: round trips on the same and on other world sizes and strategies (bit-exact
// params and optimizer state), loading into an unsharded model, another model's checkpoint
// rejected naming the tensor, atomic commit and `latest`, keep-last retention, async saves that
// keep the values at the call, and a failure on one rank failing every rank with nothing committed.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <utility>
#include <vector>

#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "base/file_io.h"
#include "checkpoint/save_job.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {
using io::exists;
using io::join;
using testing::Net;
using testing::NetOptions;
using testing::snapshot_files;

std::mutex g_seed_mutex;

NetOptions ckpt_net() {
  NetOptions o;
  o.in = 7, o.dim = 15, o.hidden = 13, o.out = 1, o.blocks = 2;  // head [1, 15]: fewer rows than ranks
  return o;
}

ParamInitFn net_init(uint64_t seed) { return init::normal(0.2, seed); }

using Trained = testing::ShardedModel;

// A sharded Net on `mesh`, deterministically initialised and trained for `steps` steps.
Trained make_trained(DeviceMesh& mesh, int steps, ShardingStrategy strategy = ShardingStrategy::kFullShard,
                     NetOptions o = ckpt_net()) {
  testing::ShardedModelOptions options;
  o.device = at::kMeta;
  options.net = o;
  options.shard.strategy(strategy).init(net_init(3));
  Trained t = testing::make_sharded_model(mesh, options);
  const int n = mesh.dist().world_size(), r = mesh.dist().rank();
  for (int s = 0; s < steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + s);
    auto x = at::randn({12, o.in}, gen), y = at::randn({12, o.out}, gen);
    const int64_t local = 12 / n;
    testing::train_on_batch(t, x.narrow(0, r * local, local), y.narrow(0, r * local, local));
  }
  if (steps == 0) fsdp::testing::units(*t.root);  // lazy init: materialise the shards
  return t;
}

std::string tmp_dir(const std::string& stem) {
  const std::string p = fsdp::testing::temp_path(stem);
  io::make_dirs(p);
  return p;
}

// Full tensors by name, as an unsharded model loaded from the checkpoint holds them.
std::map<std::string, at::Tensor> full_params(const std::string& dir) {
  Net ref(ckpt_net());
  checkpoint::load_unsharded(dir, *ref);
  std::map<std::string, at::Tensor> out;
  for (auto& item : ref->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// Every rank's shard equals the matching slice of the full tensors.
void expect_shards_match(FSDPModule& root, const std::map<std::string, at::Tensor>& full) {
  for (const auto& unit : fsdp::testing::units(root)) {
    for (auto& fp : unit->flat_params()) {
      std::vector<at::Tensor> parts;
      for (const auto& e : fp->entries()) parts.push_back(full.at(unit->prefix() + e.name).reshape({-1}));
      auto flat = at::constant_pad_nd(at::cat(parts), {0, fp->padded_numel() - fp->numel()});
      EXPECT_TRUE(at::equal(fp->sharded_param(), flat.narrow(0, fp->shard_offset(), fp->shard_numel())))
          << unit->name() << " rank " << fsdp::testing::unit(root).mesh().dist().rank();
    }
  }
}

void save_on(int world, const std::string& root_dir, const std::string& name, int steps,
             ShardingStrategy strategy = ShardingStrategy::kFullShard) {
  testing::run_threads(world, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, steps, strategy);
    checkpoint::TrainState st;
    st.step = steps;
    st.samples_seen = 12 * steps;
    st.extra["note"] = "hello";
    checkpoint::save(root_dir, name, *t.root, t.optim.get(), st);
  });
}

TEST(Checkpoint, RoundTripSameWorldSizeIsBitExact) {
  const std::string dir = tmp_dir("ckpt-rt");
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto a = make_trained(mesh, 3);
    checkpoint::TrainState st;
    st.step = 3;
    st.samples_seen = 36;
    checkpoint::save(dir, "step-00000003", *a.root, a.optim.get(), st);
    auto b = make_trained(mesh, 0);
    auto loaded = checkpoint::load(checkpoint::resolve(dir, "latest"), *b.root, b.optim.get());
    EXPECT_EQ(loaded.step, 3);
    EXPECT_EQ(loaded.samples_seen, 36);
    EXPECT_EQ(loaded.world_size, 2);
    EXPECT_EQ(loaded.strategy, "FULL_SHARD");
    auto ua = fsdp::testing::units(*a.root), ub = fsdp::testing::units(*b.root);
    for (size_t u = 0; u < ua.size(); ++u) {
      for (size_t f = 0; f < ua[u]->flat_params().size(); ++f) {
        EXPECT_TRUE(at::equal(ua[u]->flat_params()[f]->sharded_param(), ub[u]->flat_params()[f]->sharded_param()));
      }
    }
    ASSERT_EQ(a.optim->states().size(), b.optim->states().size());
    for (size_t i = 0; i < a.optim->states().size(); ++i) {
      EXPECT_EQ(a.optim->states()[i].step, b.optim->states()[i].step);
      for (const auto& name : {"exp_avg", "exp_avg_sq"}) {
        EXPECT_TRUE(at::equal(a.optim->states()[i].tensors.at(name), b.optim->states()[i].tensors.at(name))) << name;
      }
    }
  });
}

class CrossSize : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(CrossSize, LoadsOnAnotherWorldSize) {
  const auto [from, to] = GetParam();
  const std::string dir = tmp_dir("ckpt-x");
  save_on(from, dir, "step-00000002", 2);
  const auto full = full_params(join(dir, "step-00000002"));
  testing::run_threads(to, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 0);
    auto st = checkpoint::load(checkpoint::resolve(dir, "latest"), *t.root, t.optim.get());
    EXPECT_EQ(st.world_size, from);
    EXPECT_EQ(st.extra["note"], "hello");
    expect_shards_match(*t.root, full);
    for (auto& s : t.optim->states()) EXPECT_EQ(s.step, 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Pairs, CrossSize,
                         ::testing::Values(std::make_pair(1, 2), std::make_pair(2, 1), std::make_pair(1, 3),
                                           std::make_pair(3, 1), std::make_pair(2, 3), std::make_pair(3, 2),
                                           std::make_pair(2, 4), std::make_pair(4, 3)),
                         [](const auto& info) {
                           return "from" + std::to_string(info.param.first) + "to" + std::to_string(info.param.second);
                         });

TEST(Checkpoint, SavedFullShardLoadsAsShardGradOpAndNoShard) {
  const std::string dir = tmp_dir("ckpt-strat");
  save_on(2, dir, "s", 2, ShardingStrategy::kFullShard);
  const auto full = full_params(join(dir, "s"));
  for (auto strategy : {ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      auto t = make_trained(mesh, 0, strategy);
      checkpoint::load(join(dir, "s"), *t.root, t.optim.get());
      expect_shards_match(*t.root, full);
    });
  }
}

TEST(Checkpoint, AnotherModelIsRejectedNamingTheTensor) {
  const std::string dir = tmp_dir("ckpt-other");
  save_on(1, dir, "s", 1);
  auto expect_error = [&](NetOptions o, const std::string& needle) {
    auto dist = Dist::single();
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 0, ShardingStrategy::kFullShard, o);
    try {
      checkpoint::load(join(dir, "s"), *t.root, t.optim.get());
      ADD_FAILURE() << "loaded a checkpoint of another model; expected: " << needle;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  NetOptions reshaped = ckpt_net();
  reshaped.hidden = 14;
  expect_error(reshaped, "'blocks_0.fc1.weight' has shape [13, 15] but the model's has shape [14, 15]");
  NetOptions more = ckpt_net();
  more.blocks = 3;
  expect_error(more, "has no tensor 'blocks_2.fc1.weight'");
  NetOptions fewer = ckpt_net();
  fewer.blocks = 1;
  expect_error(fewer, "has tensor 'blocks_1.fc1.bias' that the model does not have");
}

TEST(Checkpoint, UncommittedDirectoryIsNeverLoaded) {
  const std::string dir = tmp_dir("ckpt-uncommitted");
  save_on(1, dir, "step-00000001", 1);
  io::make_dirs(join(dir, "step-00000002.tmp"));
  io::make_dirs(join(dir, "step-00000003"));  // no train_state.json
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), join(dir, "step-00000001"));
  EXPECT_THROW(checkpoint::resolve(dir, join(dir, "step-00000003")), CheckpointError);
  EXPECT_THROW(checkpoint::resolve(tmp_dir("ckpt-empty"), "latest"), CheckpointError);
}

TEST(Checkpoint, KeepLastRetention) {
  const std::string dir = tmp_dir("ckpt-keep");
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 1);
    for (int s = 1; s <= 4; ++s) {
      checkpoint::TrainState st;
      st.step = s;
      char name[32];
      std::snprintf(name, sizeof(name), "step-%08d", s);
      checkpoint::save(dir, name, *t.root, t.optim.get(), st, checkpoint::SaveOptions().keep_last(2));
    }
  });
  const std::vector<std::string> names = io::list_dir(dir);
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000003", "step-00000004"}));
}

// keep_last keeps the newest by the step each checkpoint records, then by commit order, never by
// name: "step9" sorts after "step10" and "step11", and names without a number, saved without a
// step, keep the order they were committed in.
TEST(Checkpoint, KeepLastKeepsTheNewestByStepThenCommitOrder) {
  const std::string dir = tmp_dir("ckpt-keep-order");
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 1);
    auto save = [&](const std::string& root, const std::string& name, int64_t step) {
      checkpoint::TrainState st;
      st.step = step;
      checkpoint::save(join(dir, root), name, *t.root, t.optim.get(), st, checkpoint::SaveOptions().keep_last(2));
    };
    for (int s = 1; s <= 11; ++s) save("numbered", "step" + std::to_string(s), s);
    for (const char* name : {"zulu", "alpha", "mike"}) save("unnumbered", name, 0);
  });
  EXPECT_EQ(io::list_dir(join(dir, "numbered")), (std::vector<std::string>{"latest", "step10", "step11"}));
  EXPECT_EQ(io::list_dir(join(dir, "unnumbered")), (std::vector<std::string>{"alpha", "latest", "mike"}));
  EXPECT_EQ(checkpoint::resolve(join(dir, "unnumbered"), "latest"), join(join(dir, "unnumbered"), "mike"));
  io::remove_tree(dir);
}

// Writes the file `path` until the file system that holds it is full.
void fill_up(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::vector<char> block(64 << 10, 1);
  while (::write(fd, block.data(), block.size()) > 0) {
  }
  EXPECT_EQ(errno, ENOSPC) << std::strerror(errno);
  ::close(fd);
}

// A save into a file system that fills up (a 1 MiB tmpfs mounted for the test: skipped where
// mounting is not permitted) fails on every rank and leaves no NAME.tmp; the earlier checkpoint
// stays `latest` and loads; the orphan a killed save left (its lock file unlocked) is cleared,
// while a save in progress elsewhere (its lock file held) is left alone; once space returns, the
// next save commits with nothing left over (Note [Orphaned saves]).
TEST(Checkpoint, FullDiskSaveLeavesNothingBehindAndOrphansAreCleared) {
  const std::string dir = tmp_dir("ckpt-full");
  if (::mount("tmpfs", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m") != 0) {
    const int err = errno;
    io::remove_tree(dir);
    GTEST_SKIP() << "cannot mount a 1 MiB tmpfs at " << dir << " (" << std::strerror(err)
                 << "): this test needs root with the right to mount";
  }
  struct Unmount {
    std::string dir;
    ~Unmount() {
      ::umount2(dir.c_str(), MNT_DETACH);
      io::remove_tree(dir);
    }
  } unmount{dir};
  save_on(2, dir, "first", 1);
  const auto before = snapshot_files(join(dir, "first"));
  const std::string lock_file = ".fsdp-save.lock";  // save.cpp's kLockFile
  for (const char* orphan : {"killed.tmp", "elsewhere.tmp"}) {
    io::make_dirs(join(dir, orphan));
    std::ofstream(join(join(dir, orphan), lock_file)).flush();  // empty: it takes no space
  }
  const int held = ::open(join(join(dir, "elsewhere.tmp"), lock_file).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0) << std::strerror(errno);
  fill_up(join(dir, "filler"));
  std::mutex mu;
  std::vector<std::string> errors;
  auto save = [&](const std::string& name) {
    testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      auto t = make_trained(mesh, 2);
      try {
        checkpoint::save(dir, name, *t.root, t.optim.get(), {});
      } catch (const CheckpointError& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    });
  };
  save("second");
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find(std::strerror(ENOSPC)), std::string::npos) << errors[0];
  EXPECT_EQ(io::list_dir(dir), (std::vector<std::string>{"elsewhere.tmp", "filler", "first", "latest"}));
  EXPECT_EQ(snapshot_files(join(dir, "first")), before);
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), join(dir, "first"));
  EXPECT_FALSE(full_params(join(dir, "first")).empty());
  io::remove_tree(join(dir, "filler"));  // space returns
  errors.clear();
  save("third");
  EXPECT_TRUE(errors.empty()) << errors[0];
  EXPECT_EQ(io::list_dir(dir), (std::vector<std::string>{"elsewhere.tmp", "first", "latest", "third"}));
  ::close(held);  // the save elsewhere died: its NAME.tmp is an orphan now
  save("fourth");
  EXPECT_TRUE(errors.empty()) << errors[0];
  EXPECT_EQ(io::list_dir(dir), (std::vector<std::string>{"first", "fourth", "latest", "third"}));
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), join(dir, "fourth"));
}

// Pages of `path` in the page cache now, and in all.
std::pair<int64_t, int64_t> cached_pages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || st.st_size == 0) {
    if (fd >= 0) ::close(fd);
    return {0, 0};
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  std::vector<unsigned char> pages((st.st_size + 4095) / 4096);
  if (map == MAP_FAILED || ::mincore(map, static_cast<size_t>(st.st_size), pages.data()) != 0) return {-1, 0};
  ::munmap(map, static_cast<size_t>(st.st_size));
  int64_t cached = 0;
  for (unsigned char p : pages) cached += p & 1;
  return {cached, static_cast<int64_t>(pages.size())};
}

TEST(Checkpoint, SaveWritesItsShardsAroundThePageCache) {
  // Each rank's shards go to the disk directly (Note [Direct writes of a checkpoint]): through the
  // page cache the save ran at the kernel's writeback speed, a third of the disk's here. Only the
  // pages a rank shares with a neighbour (the header, another rank's bytes) pass through the cache.
  const std::string dir = tmp_dir("ckpt-direct");
  const int probe = ::open(join(dir, "probe").c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (probe < 0) GTEST_SKIP() << "the file system under " << dir << " refuses O_DIRECT";
  ::close(probe);
  NetOptions o = ckpt_net();
  o.dim = 256, o.hidden = 1024;  // ~525k parameters a block: files of 2,000 pages or more
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 1, ShardingStrategy::kFullShard, o);
    checkpoint::TrainState st;
    st.step = 1;
    checkpoint::save(dir, "step-1", *t.root, t.optim.get(), st);
  });
  for (const std::string file : {"model", "optim.exp_avg", "optim.exp_avg_sq"}) {
    const auto [cached, pages] = cached_pages(join(join(dir, "step-1"), file + ".safetensors"));
    ASSERT_GT(pages, 1000) << file;
    EXPECT_LT(cached, 32) << file << ": " << cached << " of its " << pages << " pages went through the page cache";
  }
  io::remove_tree(dir);
}

TEST(Checkpoint, AsyncSaveKeepsTheValuesAtTheCall) {
  const std::string dir = tmp_dir("ckpt-async");
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 2);
    std::vector<at::Tensor> at_call;
    for (const auto& unit : fsdp::testing::units(*t.root)) {
      for (auto& fp : unit->flat_params()) at_call.push_back(fp->sharded_param().clone());
    }
    checkpoint::AsyncSaver saver;
    checkpoint::TrainState st;
    st.step = 2;
    saver.save(dir, "async", *t.root, t.optim.get(), st);
    // Training goes on while the save is written; the save must hold the values at the call.
    for (const auto& unit : fsdp::testing::units(*t.root)) {
      for (auto& fp : unit->flat_params()) fp->sharded_param().add_(1.0);
    }
    saver.wait();
    auto b = make_trained(mesh, 0);
    checkpoint::load(join(dir, "async"), *b.root, nullptr);
    size_t i = 0;
    for (const auto& unit : fsdp::testing::units(*b.root)) {
      for (auto& fp : unit->flat_params()) EXPECT_TRUE(at::equal(fp->sharded_param(), at_call[i++]));
    }
  });
}

TEST(Checkpoint, FailureOnOneRankFailsEveryRankAndCommitsNothing) {
  const std::string dir = tmp_dir("ckpt-fail");
  save_on(2, dir, "step-00000001", 1);
  // Rank 1 cannot write: the checkpoint root is read-only for it (simulated with a file in the
  // way of its temporary directory is not possible per rank, so make the root unwritable).
  ::chmod(dir.c_str(), 0555);
  const bool root_user = ::geteuid() == 0;  // root ignores permissions: use a file as the root dir
  std::string target = dir;
  if (root_user) {
    target = join(dir, "not-a-dir");
    ::chmod(dir.c_str(), 0755);
    std::ofstream(target) << "x";
  }
  std::mutex mu;
  std::vector<std::string> errors;
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 1);
    try {
      checkpoint::save(target, "step-00000002", *t.root, t.optim.get(), {});
    } catch (const CheckpointError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ::chmod(dir.c_str(), 0755);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_NE(errors[0].find("failed on rank 0"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("nothing was committed"), std::string::npos) << errors[0];
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), join(dir, "step-00000001"));
}

TEST(Checkpoint, WriteFailureOnRank1FailsEveryRankNamingIt) {
  const std::string dir = tmp_dir("ckpt-rank1");
  save_on(2, dir, "step-00000001", 1);
  checkpoint::set_fault_hook_for_testing([](const std::string& phase, int rank) {
    if (phase == "write" && rank == 1) throw CheckpointError("No space left on device (injected)");
  });
  std::mutex mu;
  std::vector<std::string> errors;
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 1);
    try {
      checkpoint::save(dir, "step-00000002", *t.root, t.optim.get(), {});
    } catch (const CheckpointError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  checkpoint::set_fault_hook_for_testing(nullptr);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_NE(errors[0].find("failed on rank 1 while writing its shards: No space left on device"), std::string::npos)
      << errors[0];
  EXPECT_FALSE(exists(join(dir, "step-00000002")));
  EXPECT_FALSE(exists(join(dir, "step-00000002.tmp")));  // rank 0 removed what rank 1 failed to write
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), join(dir, "step-00000001"));
}

// Processes killed at each phase of a save: the previous checkpoint stays byte for byte, still
// loads, and `latest` never names the interrupted one.
class CrashDuringSave : public ::testing::TestWithParam<std::string> {};

TEST_P(CrashDuringSave, PreviousCheckpointSurvivesAndNewOneIsNeverComplete) {
  const std::string phase = GetParam();
  // Children re-run this test from the top: only the parent prepares, and passes the directory on.
  const bool child = std::getenv("FSDP_TEST_CHILD") != nullptr;
  std::string dir;
  std::map<std::string, std::string> before;
  if (child) {
    dir = std::getenv("FSDP_CRASH_DIR");
  } else {
    dir = tmp_dir("ckpt-crash-" + phase);
    save_on(2, dir, "step-00000001", 1);
    before = snapshot_files(join(dir, "step-00000001"));
    ::setenv("FSDP_CRASH_DIR", dir.c_str(), 1);
  }
  auto results = testing::run_processes(2, [&](int) {
    checkpoint::set_fault_hook_for_testing([&](const std::string& p, int rank) {
      if (p == phase && (rank == 0 || phase == "write")) ::raise(SIGKILL);
    });
    auto dist = init_from_env(InitOptions().timeout(std::chrono::seconds(5)));
    DeviceMesh mesh(dist);
    auto t = make_trained(mesh, 2);
    checkpoint::save(dir, "step-00000002", *t.root, t.optim.get(), {});
  });
  bool someone_killed = false;
  for (const auto& r : results) someone_killed = someone_killed || r.term_signal == SIGKILL;
  EXPECT_TRUE(someone_killed) << testing::describe(results);
  for (const auto& r : results) EXPECT_FALSE(r.ok()) << testing::describe(results);  // nobody reports success
  EXPECT_EQ(snapshot_files(join(dir, "step-00000001")), before);
  const std::string latest = checkpoint::resolve(dir, "latest");
  if (phase == "latest") {
    // Killed after the rename, before `latest` moved: the new directory is complete and
    // committed, and `latest` still names the previous one.
    EXPECT_TRUE(exists(join(join(dir, "step-00000002"), "train_state.json")));
  } else {
    EXPECT_FALSE(exists(join(dir, "step-00000002")));
  }
  EXPECT_EQ(latest, join(dir, "step-00000001"));
  const auto full = full_params(latest);  // and it loads
  EXPECT_FALSE(full.empty());
  if (!child) {  // the next save clears the killed one's NAME.tmp (Note [Orphaned saves])
    save_on(2, dir, "step-00000003", 3);
    EXPECT_FALSE(exists(join(dir, "step-00000002.tmp")));
  }
  if (!child) io::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Phases, CrashDuringSave, ::testing::Values("prepare", "write", "commit", "rename", "latest"));

}  // namespace
}  // namespace fsdp
