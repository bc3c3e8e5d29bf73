// Offload: training with states in the host or disk tier equals training without offload bit for
// bit (fp32, AdamW with weight decay and clipping, 2 ranks); the disk tier keeps its mapped
// resident set within the budget while it streams; the memory report counts each tier; a
// checkpoint saved and loaded with the disk tier on resumes bitwise; an unwritable offload.dir and
// a full disk fail with clear errors without changing any state or checkpoint; and the CUDA
// stager's copies (skipped without a GPU).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "fsdp/memory.h"
#include "fsdp/offload.h"
#include "buffers/buffer_storage.h"
#include "offload/device_stager.h"
#include "offload/testing.h"
#include "offload_job.h"
#include "offload/tier_tensors.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/train_ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {

// kWorld, kGlobalBatch, kBudget, Job, build, train_step, disk_policy, host_policy: offload_job.h.
using namespace offload_job;

// Trains `steps` steps on 2 thread ranks; returns each rank's fingerprint. `check` runs on each
// rank after training.
std::vector<std::string> train(const std::optional<OffloadPolicy>& offload, int steps, bool meta = true,
                               const std::function<void(Job&, int)>& check = nullptr, int skip_losses = 0) {
  return testing::train_ranks(
      kWorld,
      [&](DeviceMesh& mesh, int rank) {
        Job j = build(mesh, offload, meta);
        if (offload) set_disk_tier_audit(*j.root, true);
        std::vector<double> losses;
        for (int s = 0; s < steps; ++s) {
          const double loss = train_step(j, s, rank);
          if (s >= skip_losses) losses.push_back(loss);
        }
        if (check) check(j, rank);
        return testing::state_bytes(losses, *j.root, j.optim.get());
      },
      std::chrono::seconds(60));
}

// Note [Reusing freed host buffers]: a freed buffer's block is handed to the next buffer of its
// size, and freed at the first allocation of another size. Before, it waited until two more blocks
// were freed: a split root's embedding freed after its forward waited through every layer's
// (the forward's peak at Llama-3.1-8B, 1 GiB over its plan).
TEST(Offload, AFreedBlockWaitsForItsOwnSizeOnly) {
  auto resident = [] {
    long pages = 0, resident_pages = 0;
    std::ifstream("/proc/self/statm") >> pages >> resident_pages;
    return static_cast<int64_t>(resident_pages) * ::sysconf(_SC_PAGESIZE);
  };
  buffers::release_freed_host_blocks();
  const int64_t big = int64_t{64} << 20;  // above glibc's largest mmap threshold: its own mapping
  at::Tensor t = at::ones({big / 4});
  const void* block = t.data_ptr();
  buffers::set_storage_alive(t, false);
  buffers::set_storage_alive(t, true);  // the same size: the block kept, its pages still there
  EXPECT_EQ(t.data_ptr(), block);
  buffers::set_storage_alive(t, false);
  at::Tensor small = at::ones({1024});
  buffers::set_storage_alive(small, false);
  const int64_t before = resident();
  buffers::set_storage_alive(small, true);  // another size: the 64 MiB block is freed
  EXPECT_EQ(small.numel(), 1024);
  EXPECT_GT(before - resident(), big * 9 / 10) << "the kept 64 MiB block outlived an allocation of another size";
  buffers::set_storage_alive(t, true);
  t.fill_(2.0f);
  EXPECT_EQ(t.sum().item<double>(), 2.0 * static_cast<double>(big / 4));
  buffers::release_freed_host_blocks();
}

TEST(Offload, DiskTierEqualsInMemoryTrainingBitwise) {
  const std::string dir = testing::temp_path("offload-disk");
  const auto reference = train(std::nullopt, 4);
  const auto disk = train(disk_policy(dir), 4, true, [&](Job& j, int rank) {
    // The states really are in files, and the streamed step stayed within the budget.
    for (const auto& unit : fsdp::testing::units(*j.root)) {
      for (auto& fp : unit->flat_params()) EXPECT_TRUE(offload::is_disk_backed(fp->sharded_param()));
    }
    for (auto& st : j.optim->states()) {
      for (const auto& [name, t] : st.tensors) EXPECT_TRUE(offload::is_disk_backed(t)) << name;
    }
    const auto stats = disk_tier_stats(*j.root);
    EXPECT_EQ(stats.dir, dir);
    EXPECT_GT(stats.file_bytes, 0);
    EXPECT_GT(stats.peak_resident_bytes, 0) << "the audit saw nothing: the test would pass vacuously";
    EXPECT_LE(stats.peak_resident_bytes, kBudget) << "rank " << rank;
    EXPECT_LE(stats.resident_bytes, kBudget) << "rank " << rank;
  });
  ASSERT_EQ(reference.size(), disk.size());
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_GT(reference[r].size(), 1000u);
    EXPECT_TRUE(reference[r] == disk[r]) << "rank " << r << ": disk tier differs from in-memory training";
  }
  // Gradient shards on disk too.
  const auto with_grads = train(disk_policy(dir, /*grads=*/true).memory_budget_bytes(4 * 3 * 4096), 4);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(reference[r] == with_grads[r]) << "rank " << r << " (grads on disk)";
  // Negative control: a different run does differ, so equality above means something.
  const auto shorter = train(std::nullopt, 3);
  EXPECT_FALSE(reference[0] == shorter[0]);
  io::remove_tree(dir);
}

TEST(Offload, HostTierEqualsNoOffloadBitwise) {
  // Meta init (deferred) and real parameters (copied into the tier) both.
  for (bool meta : {true, false}) {
    const auto reference = train(std::nullopt, 4, meta);
    const auto host = train(host_policy(), 4, meta, [](Job& j, int) {
      for (const auto& unit : fsdp::testing::units(*j.root)) {
        for (auto& fp : unit->flat_params()) {
          EXPECT_EQ(fp->offload().params, OffloadTier::kHost);
          ASSERT_TRUE(fp->offload().stager != nullptr);
          EXPECT_STREQ(fp->offload().stager->name(), "cpu");
        }
      }
    });
    for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(reference[r] == host[r]) << "rank " << r << " meta " << meta;
  }
}

// One rank, fp32: the backward accumulates straight into the gradient shard (Note [One-rank
// gradients] in flat_param.cpp): no unsharded gradient buffer of its own, across micro-batches
// without sync too. Gradients in the host tier keep the buffer and the copy out; both runs are
// the same bits.
TEST(Offload, OneRankGradientsAccumulateInTheShardBitwise) {
  auto run = [](const std::optional<OffloadPolicy>& offload, bool expect_alias) {
    at::set_num_threads(1);
    auto dist = Dist::single();
    DeviceMesh mesh(dist);
    Job j = build(mesh, offload, /*meta=*/false);
    std::vector<double> losses;
    int64_t most_buffer_bytes = 0;
    for (int64_t step = 0; step < 4; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + step);
      auto x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
      for (int64_t micro = 0; micro < 3; ++micro) {
        j.root->set_requires_gradient_sync(micro == 2);
        at::Tensor loss = at::mse_loss(fsdp::call(j.model, x.narrow(0, micro * 2, 2)), y.narrow(0, micro * 2, 2));
        loss.backward();
        losses.push_back(loss.item<double>());
        for (auto* fp : fsdp::testing::flat_params(*j.root)) {
          most_buffer_bytes = std::max(most_buffer_bytes, fp->unsharded_grad_bytes());
          if (expect_alias) EXPECT_TRUE(fp->sharded_grad().defined()) << fp->config().tag;
        }
      }
      clip_grad_norm(*j.root, 0.5);
      j.optim->step();
      j.optim->zero_grad();
    }
    if (expect_alias) {
      EXPECT_EQ(most_buffer_bytes, 0) << "a one-rank fp32 flat param kept a gradient buffer of its own";
    } else {
      EXPECT_GT(most_buffer_bytes, 0) << "gradients in the host tier went through no buffer: the runs compare nothing";
    }
    return testing::state_bytes(losses, *j.root, j.optim.get());
  };
  const std::string in_shard = run(std::nullopt, true);
  const std::string buffered = run(OffloadPolicy().grads(OffloadTier::kHost), false);
  EXPECT_TRUE(in_shard == buffered);
}

TEST(Offload, PerUnitPolicyOverridesTheRoots) {
  const std::string dir = testing::temp_path("offload-per-unit");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    auto model = testing::Net(net_options(true));
    auto opts = FullyShardOptions().init(init::normal(0.2, 11));
    // Block 0 keeps everything in memory; the others inherit the root's disk policy.
    fully_shard(model->blocks[0], mesh, FullyShardOptions(opts).offload(OffloadPolicy()));
    for (size_t i = 1; i < model->blocks.size(); ++i) fully_shard(model->blocks[i], mesh, opts);
    auto root = fully_shard(model, mesh, FullyShardOptions(opts).offload(disk_policy(dir)));
    AdamW optim(root, AdamWOptions(1e-2));
    for (const auto& unit : fsdp::testing::units(*root)) {
      const bool in_memory = unit->prefix() == "blocks_0.";
      for (auto& fp : unit->flat_params()) {
        EXPECT_EQ(offload::is_disk_backed(fp->sharded_param()), !in_memory) << unit->name();
      }
    }
  });
  io::remove_tree(dir);
}

TEST(Offload, MemoryReportCountsEachTier) {
  const std::string dir = testing::temp_path("offload-report");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    Job j = build(mesh, disk_policy(dir));
    train_step(j, 0, dist->rank());
    const auto r = memory_report(*j.root, j.optim.get());
    EXPECT_EQ(r.tier_disk, r.sharded_params + r.optimizer_state);
    EXPECT_EQ(r.tier_device, r.sharded_grads);
    EXPECT_EQ(r.tier_host, 0);
    EXPECT_EQ(r.model_state(), r.tier_device + r.tier_host + r.tier_disk);
    EXPECT_NE(r.to_string().find("disk"), std::string::npos) << r.to_string();
    Job h = build(mesh, host_policy());
    train_step(h, 0, dist->rank());
    const auto rh = memory_report(*h.root, h.optim.get());
    EXPECT_EQ(rh.tier_host, rh.model_state());
    EXPECT_EQ(rh.tier_disk, 0);
  });
  io::remove_tree(dir);
}

TEST(Offload, ResumeFromCheckpointWithDiskTierBitwise) {
  const std::string dir = testing::temp_path("offload-resume");
  io::make_dirs(dir);
  const std::string ckpt = io::join(dir, "ckpt");
  const auto straight = train(std::nullopt, 6);
  // 3 steps and an async save with the disk tier on; then a fresh model with the disk tier loads
  // and runs 3 more.
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, disk_policy(io::join(dir, "offload-a")));
        for (int s = 0; s < 3; ++s) train_step(j, s, dist->rank());
        checkpoint::TrainState st;
        st.step = 3;
        // A background save: its snapshot of the disk-tier state (disk-tier files too) must not see
        // the step that runs while it writes.
        checkpoint::AsyncSaver saver;
        saver.save(ckpt, "step-3", *j.root, j.optim.get(), st);
        train_step(j, 3, dist->rank());
        saver.wait();
      },
      std::chrono::seconds(60));
  std::vector<std::string> resumed(kWorld);
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, disk_policy(io::join(dir, "offload-b")));
        set_disk_tier_audit(*j.root, true);
        const auto st = checkpoint::load(checkpoint::resolve(ckpt, "latest"), *j.root, j.optim.get());
        EXPECT_EQ(st.step, 3);
        // Loaded in place: the states are still in the disk tier, and loading left nothing mapped.
        for (const auto& unit : fsdp::testing::units(*j.root)) {
          for (auto& fp : unit->flat_params()) EXPECT_TRUE(offload::is_disk_backed(fp->sharded_param()));
        }
        for (auto& s : j.optim->states()) {
          for (const auto& [name, t] : s.tensors) EXPECT_TRUE(offload::is_disk_backed(t)) << name;
        }
        EXPECT_LE(disk_tier_stats(*j.root).resident_bytes, kBudget);
        std::vector<double> losses;
        for (int s = 3; s < 6; ++s) losses.push_back(train_step(j, s, dist->rank()));
        resumed[dist->rank()] = testing::state_bytes(losses, *j.root, j.optim.get());
      },
      std::chrono::seconds(60));
  const auto straight_tail = train(std::nullopt, 6, true, nullptr, /*skip_losses=*/3);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_GT(straight_tail[r].size(), 1000u);
    EXPECT_TRUE(resumed[r] == straight_tail[r]) << "rank " << r << ": resumed with the disk tier differs";
  }
  EXPECT_FALSE(straight[0] == straight_tail[0]);  // the fingerprints do see the losses
  io::remove_tree(dir);
}

TEST(Offload, SaveReadsEachDiskTierStateOnceThroughTheIoThreads) {
  // A save reads the master and the optimizer state on the tier's read thread, in chunks read
  // ahead, each byte once: through their mappings (MADV_RANDOM), the kernel faulted them in a page
  // at a time (a 150M-parameter model on 2 ranks saved at 60 MB/s against a disk of 1.3 GB/s).
  const std::string dir = testing::temp_path("offload-save-reads");
  io::make_dirs(dir);
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, disk_policy(io::join(dir, "tier-" + std::to_string(dist->rank()))));
        train_step(j, 0, dist->rank());
        int64_t bytes = 0, page_bytes = 0;  // of the disk-tier tensors a save reads
        auto count = [&](const at::Tensor& t) {
          ASSERT_TRUE(offload::is_disk_backed(t));
          bytes += t.numel() * 4;
          page_bytes += offload::whole_pages(t.numel() * 4);
        };
        for (const auto& unit : fsdp::testing::units(*j.root)) {
          for (auto& fp : unit->flat_params()) count(fp->sharded_param());
        }
        for (auto& s : j.optim->states()) {
          for (const auto& [name, t] : s.tensors) count(t);
        }
        const OffloadIo before = offload_io(*j.root);
        checkpoint::TrainState st;
        st.step = 1;
        checkpoint::save(io::join(dir, "ckpt"), "step-1", *j.root, j.optim.get(), st);
        const OffloadIo moved = offload_io(*j.root) - before;
        EXPECT_GE(moved.disk_read, bytes) << "the save read the disk tier through its mappings";
        // Each byte once; a run of tensors apart from the rest of its flat param in the file (the
        // root's first and last layers) starts on the page where the one before it ended.
        const int64_t runs = 3 * static_cast<int64_t>(j.model->parameters().size());  // at most
        EXPECT_LE(moved.disk_read, page_bytes + runs * 4096) << "the save read the disk tier more than once";
        EXPECT_EQ(moved.disk_write, 0);
      },
      std::chrono::seconds(60));
  io::remove_tree(dir);
}

// Uses the process tier: the file-size limit and SIGXFSZ are per process.
void full_disk_child(int rank) {
  at::set_num_threads(1);
  std::signal(SIGXFSZ, SIG_IGN);  // fallocate past the limit then fails with EFBIG instead of killing us
  const std::string dir = std::getenv("FSDP_OFFLOAD_DIR");
  auto dist = init_from_env(InitOptions().timeout(std::chrono::seconds(20)));
  DeviceMesh mesh(dist);
  const std::string mode = std::getenv("FSDP_OFFLOAD_MODE");
  struct rlimit lim {};
  ::getrlimit(RLIMIT_FSIZE, &lim);
  const rlim_t unlimited = lim.rlim_cur;
  if (mode == "params") {
    // The directory's probe (4 KiB) passes, the blocks' master shards (~80 KiB) need more than the
    // limit: fails while the root places its states, before any training.
    lim.rlim_cur = 8192;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    try {
      Job j = build(mesh, disk_policy(dir));
      FAIL() << "placing the master shards should have failed";
    } catch (const OffloadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(dir), std::string::npos) << what;
      EXPECT_NE(what.find("cannot reserve"), std::string::npos) << what;
      EXPECT_NE(what.find("master shard"), std::string::npos) << what;
    }
    return;
  }
  if (mode == "midstep") {
    // Params and AdamW state on disk, trained and saved; then the file-size limit drops below the
    // tier's files: the next step's write-behind fails with EFBIG, which a full disk also gives.
    Job j = build(mesh, disk_policy(dir));
    for (int s = 0; s < 2; ++s) train_step(j, s, rank);
    checkpoint::TrainState st;
    st.step = 2;
    const std::string ckpt = io::join(dir, "ckpt-midstep");
    checkpoint::save(ckpt, "step-2", *j.root, j.optim.get(), st);
    const std::string saved = testing::state_bytes({}, *j.root, j.optim.get());
    lim.rlim_cur = 4096;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    try {
      train_step(j, 2, rank);
      FAIL() << "a step whose writes cannot land should fail";
    } catch (const OffloadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(dir), std::string::npos) << what;
      EXPECT_NE(what.find("writing"), std::string::npos) << what;
      EXPECT_NE(what.find("bytes"), std::string::npos) << what;
      EXPECT_NE(what.find("File too large"), std::string::npos) << what;
      EXPECT_NE(what.find("of blocks_"), std::string::npos) << what;  // names the unit
    }
    lim.rlim_cur = unlimited;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    // The last checkpoint is intact: a fresh model loads it to the saved state.
    Job k = build(mesh, disk_policy(dir));
    EXPECT_EQ(checkpoint::load(checkpoint::resolve(ckpt, "latest"), *k.root, k.optim.get()).step, 2);
    EXPECT_TRUE(testing::state_bytes({}, *k.root, k.optim.get()) == saved) << "the checkpoint changed";
    return;
  }
  // mode "state": params in memory, optimizer state on a "full" disk. Save a checkpoint first.
  auto policy = OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(dir).memory_budget_bytes(kBudget);
  Job j = build(mesh, policy);
  train_step(j, 0, rank);  // the first step reserves the state: fine, no limit yet
  checkpoint::TrainState st;
  st.step = 1;
  checkpoint::save(io::join(dir, "ckpt"), "step-1", *j.root, j.optim.get(), st);
  Job k = build(mesh, policy);  // a second model whose state must be created under the limit
  const std::string before = testing::state_bytes({}, *k.root);
  lim.rlim_cur = 8192;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto x = at::randn({4, 7}, gen), y = at::randn({4, 5}, gen);
  at::mse_loss(fsdp::call(k.model, x), y).backward();
  try {
    k.optim->step();
    FAIL() << "the optimizer step should have failed to reserve its state";
  } catch (const OffloadError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir), std::string::npos) << what;
    EXPECT_NE(what.find("AdamW exp_avg"), std::string::npos) << what;
  }
  // Nothing changed: the params are as before and no state stepped.
  EXPECT_TRUE(testing::state_bytes({}, *k.root) == before) << "a failed step changed the params";
  for (auto& s : k.optim->states()) EXPECT_EQ(s.step, 0);
  // The checkpoint is intact and loads; with room again, the step runs.
  lim.rlim_cur = unlimited;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  Job l = build(mesh, policy);
  EXPECT_EQ(checkpoint::load(checkpoint::resolve(io::join(dir, "ckpt"), "latest"), *l.root, l.optim.get()).step, 1);
  for (size_t i = 0; i < l.optim->states().size(); ++i) {
    EXPECT_TRUE(at::equal(l.optim->states()[i].tensors.at("exp_avg"), j.optim->states()[i].tensors.at("exp_avg")));
  }
  k.optim->step();
  for (auto& s : k.optim->states()) EXPECT_EQ(s.step, 1);
}

TEST(Offload, FullDiskFailsClearlyWithoutChangingState) {
  if (std::getenv("FSDP_TEST_CHILD") != nullptr) {
    testing::run_processes(kWorld, full_disk_child);
    return;
  }
  const std::string dir = testing::temp_path("offload-full");
  io::make_dirs(dir);
  for (const std::string mode : {"params", "state", "midstep"}) {
    testing::ProcessOptions opts;
    opts.extra_env = {{"FSDP_OFFLOAD_DIR", dir}, {"FSDP_OFFLOAD_MODE", mode}};
    testing::expect_all_ok(testing::run_processes(kWorld, full_disk_child, opts));
  }
  io::remove_tree(dir);
}

TEST(Offload, UnwritableDirFailsBeforeTraining) {
  // A directory that cannot be created (its parent is a file), and, when not root (root ignores
  // permission bits), an existing read-only directory.
  const std::string file = testing::temp_path("offload-file");
  std::ofstream(file) << "x";
  std::vector<std::string> dirs{io::join(file, "offload")};
  const std::string ro = testing::temp_path("offload-ro");
  if (::geteuid() != 0) {
    io::make_dirs(ro);
    ::chmod(ro.c_str(), 0500);
    dirs.push_back(ro);
  }
  for (const auto& dir : dirs) {
    testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      try {
        Job j = build(mesh, disk_policy(dir));  // AdamW's constructor runs the root's lazy init
        ADD_FAILURE() << "no error for offload.dir " << dir;
      } catch (const OffloadError& e) {
        EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
      }
    });
  }
  // Inconsistent policies are refused naming the field.
  EXPECT_THROW(OffloadPolicy().params(OffloadTier::kDisk).validate(), ConfigError);
  EXPECT_THROW(OffloadPolicy().memory_budget_bytes(-1).validate(), ConfigError);
  EXPECT_THROW(parse_offload_tier("gpu"), ConfigError);
  ::chmod(ro.c_str(), 0700);
  io::remove_tree(ro);
  ::unlink(file.c_str());
}

TEST(Offload, BudgetTooSmallToStreamIsRefused) {
  const std::string dir = testing::temp_path("offload-small");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Job j = build(mesh, disk_policy(dir).memory_budget_bytes(4096));
    const std::string before = testing::state_bytes({}, *j.root);
    try {
      train_step(j, 0, dist->rank());
      ADD_FAILURE() << "a 4096-byte budget cannot stream three tensors";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("memory_budget_bytes=4096"), std::string::npos) << what;
      EXPECT_NE(what.find("unit '"), std::string::npos) << what;       // names the unit
      EXPECT_NE(what.find("36864 bytes"), std::string::npos) << what;  // and what it needs
    }
    // Refused before anything stepped.
    EXPECT_TRUE(testing::state_bytes({}, *j.root) == before);
    for (auto& st : j.optim->states()) EXPECT_EQ(st.step, 0);
  });
  io::remove_tree(dir);
}

TEST(Offload, RealFullDiskOnATinyTmpfs) {
  // A real ENOSPC-sized file system where one can be mounted (root with CAP_SYS_ADMIN); the
  // RLIMIT_FSIZE test above covers the reservation path everywhere else.
  const std::string dir = testing::temp_path("offload-tmpfs");
  io::make_dirs(dir);
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=64k") != 0) {
    io::remove_tree(dir);
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root): " << std::strerror(errno);
  }
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    try {
      Job j = build(mesh, disk_policy(dir));
      ADD_FAILURE() << "a 64 KiB file system took the model's master shards";
    } catch (const OffloadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(dir), std::string::npos) << what;
      EXPECT_TRUE(what.find("free but") != std::string::npos || what.find("No space left") != std::string::npos)
          << what;
    }
  });
  ::umount(dir.c_str());
  io::remove_tree(dir);
}

TEST(Offload, OptimizerWithLazyStateIsRefusedBeforeAnyUpdate) {
  const std::string dir = testing::temp_path("offload-sgd");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto model = testing::Net(net_options(true));
    auto opts = FullyShardOptions().init(init::normal(0.2, 11));
    for (auto& b : model->blocks) fully_shard(b, mesh, opts);
    auto root = fully_shard(model, mesh, FullyShardOptions(opts).offload(disk_policy(dir)));
    SGD sgd(root, SGDOptions(0.1).momentum(0.9));
    auto x = at::ones({2, 7}), y = at::zeros({2, 5});
    at::mse_loss(fsdp::call(model, x), y).backward();
    const at::Tensor before = fsdp::testing::units(*root).front()->flat_params().front()->sharded_param().clone();
    try {
      sgd.step();
      ADD_FAILURE() << "SGD's momentum buffer cannot be offloaded";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("momentum_buffer"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(before, fsdp::testing::units(*root).front()->flat_params().front()->sharded_param()));
  });
  io::remove_tree(dir);
}

TEST(Offload, TierDirectoryRemovedWhileTrainingIsAClearError) {
  const std::string dir = testing::temp_path("offload-removed");
  const std::string ckpt = testing::temp_path("offload-removed-ckpt");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    Job j = build(mesh, disk_policy(dir));
    train_step(j, 0, dist->rank());
    checkpoint::TrainState st;
    st.step = 1;
    checkpoint::save(ckpt, "step-1", *j.root, j.optim.get(), st);
    const std::string saved = testing::state_bytes({}, *j.root, j.optim.get());
    dist->world().barrier("saved");
    if (dist->rank() == 0) io::remove_tree(dir);
    dist->world().barrier("removed");
    try {
      train_step(j, 1, dist->rank());
      ADD_FAILURE() << "training went on without its offload.dir";
    } catch (const OffloadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("offload.dir " + dir + " is gone"), std::string::npos) << what;
    }
    // Refused before the step changed anything, and the checkpoint loads.
    EXPECT_TRUE(testing::state_bytes({}, *j.root, j.optim.get()) == saved);
    dist->world().barrier("checked");
    Job k = build(mesh, std::nullopt);
    EXPECT_EQ(checkpoint::load(checkpoint::resolve(ckpt, "latest"), *k.root, k.optim.get()).step, 1);
    EXPECT_TRUE(testing::state_bytes({}, *k.root, k.optim.get()) == saved);
  });
  io::remove_tree(dir);
  io::remove_tree(ckpt);
}

TEST(Offload, FileSystemWithoutMmapIsRefused) {
  // No such file system is at hand: the tier's mmap is made to fail as one would (ENODEV).
  const std::string dir = testing::temp_path("offload-nommap");
  offload::testing::fail_mmap(true);
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    try {
      Job j = build(mesh, disk_policy(dir));
      ADD_FAILURE() << "a file system without mmap was accepted";
    } catch (const OffloadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("offload.dir " + dir), std::string::npos) << what;
      EXPECT_NE(what.find("cannot memory-map"), std::string::npos) << what;
    }
  });
  offload::testing::fail_mmap(false);
  io::remove_tree(dir);
}

TEST(Offload, OptimizerStateAloneEqualsNoOffloadBitwise) {
  // ZeRO-Offload's setup: params and grads with compute, the optimizer state and the fp32 master
  // in the host or disk tier, the step on the CPU twin, the working copy refreshed after it.
  const std::string dir = testing::temp_path("offload-state-only");
  for (bool meta : {true, false}) {
    const auto reference = train(std::nullopt, 4, meta);
    for (OffloadTier tier : {OffloadTier::kHost, OffloadTier::kDisk}) {
      auto policy = OffloadPolicy().optimizer_state(tier);
      if (tier == OffloadTier::kDisk) policy.dir(dir).memory_budget_bytes(kBudget);
      const auto got = train(policy, 4, meta, [&](Job& j, int) {
        for (const auto& unit : fsdp::testing::units(*j.root)) {
          for (auto& fp : unit->flat_params()) {
            EXPECT_TRUE(fp->master_follows_state());
            EXPECT_EQ(offload::is_disk_backed(fp->sharded_param()), tier == OffloadTier::kDisk);
            EXPECT_EQ(fp->working_shard().numel(), fp->shard_numel());
          }
        }
        const auto io = offload_io(*j.root);
        EXPECT_GT(io.to_host, 0) << "the gradients did not go through the stager";
        EXPECT_GT(io.to_device, 0) << "the working copy was not refreshed through the stager";
      });
      for (int r = 0; r < kWorld; ++r) {
        EXPECT_TRUE(reference[r] == got[r]) << "rank " << r << " meta " << meta << " tier " << offload_tier_name(tier);
      }
    }
  }
  io::remove_tree(dir);
}

// The plan at start against what the tiers moved, per step after the first, for each setup.
TEST(Offload, PlanAgreesWithMeasuredIoWithinTenPercent) {
  const std::string dir = testing::temp_path("offload-plan");
  const std::vector<std::pair<std::string, OffloadPolicy>> setups{
      {"disk params + state", disk_policy(dir)},
      {"host tier", host_policy()},
      {"state alone on disk",
       OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(dir).memory_budget_bytes(kBudget)},
  };
  for (const auto& [name, policy] : setups) {
    testing::run_threads(kWorld, [&, name = name, policy = policy](const std::shared_ptr<Dist>& dist) {
      at::set_num_threads(1);
      DeviceMesh mesh(dist);
      Job j = build(mesh, policy);
      const auto plan = offload_plan(*j.root, *j.optim);
      train_step(j, 0, dist->rank());
      const auto before = offload_io(*j.root);
      constexpr int kSteps = 3;
      for (int s = 1; s <= kSteps; ++s) train_step(j, s, dist->rank());
      const auto got = (offload_io(*j.root) - before).per_step(kSteps);
      auto near = [&](int64_t planned, int64_t measured, const char* what) {
        EXPECT_LE(std::abs(static_cast<double>(measured - planned)), 0.1 * static_cast<double>(planned))
            << name << ": " << what << " planned " << planned << " measured " << measured;
      };
      near(plan.per_step.disk_read, got.disk_read, "disk read");
      near(plan.per_step.disk_write, got.disk_write, "disk write");
      near(plan.per_step.to_device, got.to_device, "to device");
      near(plan.per_step.to_host, got.to_host, "to host");
      EXPECT_GT(plan.per_step.disk_read + plan.per_step.to_device, 0) << name << ": a plan of nothing";
      const auto report = memory_report(*j.root, j.optim.get());
      near(plan.disk_bytes, report.tier_disk, "disk bytes held");
      near(plan.host_bytes, report.tier_host, "host bytes held");
      near(plan.device_bytes, report.tier_device, "device bytes held");
      EXPECT_NE(plan.to_string().find("moves per step"), std::string::npos) << plan.to_string();
    });
  }
  io::remove_tree(dir);
}

// Note [The last unit keeps its params]: the last block keeps its params from forward to backward
// only when its forward runs with gradients on. Under activation checkpointing it runs without
// them, so the state machine reshards it and its recomputation gathers it again in backward: one
// more disk read of its master per step. The plan used to count one gather for the last block
// whatever its forward (its rule left out the gradient and recomputation tests); it now applies
// the state machine's rule (prefetch::keeps_params_after_forward) to the step the runtime
// recorded, so its extra read matches what the tier measures.
TEST(Offload, PlanAgreesWithRuntimeWhenTheLastBlockIsCheckpointed) {
  const std::string dir = testing::temp_path("offload-plan-ckpt");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    struct Seen {
      OffloadPlan plan;
      OffloadIo measured;
      int64_t last_read = 0;  // one read of the last block's master
      bool last_gathers_in_backward = false;
    };
    auto run = [&](int checkpoint_block) {
      Job j =
          build(mesh, disk_policy(dir + (checkpoint_block < 0 ? "/plain" : "/checkpointed")), true, checkpoint_block);
      train_step(j, 0, dist->rank());  // records the forward order and each unit's gradient mode
      Seen seen;
      seen.plan = offload_plan(*j.root, *j.optim);
      ShardedUnit& last = *fsdp::testing::units(*j.root).back();
      seen.last_read = last.disk_master_bytes();
      seen.last_gathers_in_backward = last.gathers_in_backward(/*ran_last=*/true);
      const auto before = offload_io(*j.root);
      constexpr int kSteps = 3;
      for (int s = 1; s <= kSteps; ++s) train_step(j, s, dist->rank());
      seen.measured = (offload_io(*j.root) - before).per_step(kSteps);
      return seen;
    };
    const Seen plain = run(-1);
    const Seen checkpointed = run(static_cast<int>(net_options(true).blocks) - 1);
    EXPECT_FALSE(plain.last_gathers_in_backward);
    EXPECT_TRUE(checkpointed.last_gathers_in_backward);
    ASSERT_GT(checkpointed.last_read, 0);
    EXPECT_EQ(checkpointed.plan.per_step.disk_read - plain.plan.per_step.disk_read, checkpointed.last_read);
    const int64_t measured_extra = checkpointed.measured.disk_read - plain.measured.disk_read;
    EXPECT_LE(std::abs(static_cast<double>(measured_extra - checkpointed.last_read)),
              0.1 * static_cast<double>(checkpointed.last_read))
        << "measured extra read " << measured_extra << ", one read of the last block " << checkpointed.last_read;
    EXPECT_EQ(checkpointed.plan.per_step.disk_write, plain.plan.per_step.disk_write);
  });
  io::remove_tree(dir);
}

TEST(Offload, DiskTierTransfersRunOnTheirOwnTraceLanes) {
  const std::string dir = testing::temp_path("offload-trace");
  const std::string trace = testing::temp_path("offload-trace.json");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    Job j = build(mesh, disk_policy(dir));
    auto tracer = std::make_shared<Tracer>(dist->rank());
    j.root->set_tracer(tracer);
    for (int s = 0; s < 3; ++s) train_step(j, s, dist->rank());
    if (dist->rank() == 0) tracer->write(trace);
  });
  const std::string text = io::read_small_file(trace);
  for (const char* needle :
       {"\"disk read\"", "\"disk write\"", "fsdp::disk_read\"", "fsdp::disk_write\"", "fsdp::disk_read_wait"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle;
  }
  io::remove_tree(dir);
  ::unlink(trace.c_str());
}

TEST(Offload, CudaOptimizerStateAloneMatchesNoOffload) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU: params and grads on a device need one";
  // Compiled, and the same schedule runs on CPU above; here the device keeps params and grads.
  auto dist = Dist::single(InitOptions().device("cuda"));
  DeviceMesh mesh(dist);
  auto run = [&](const std::optional<OffloadPolicy>& policy) {
    testing::ShardedModelOptions o;
    o.net = net_options(false);
    o.seed = 3;
    o.move_to = at::Device(at::kCUDA, 0);
    o.root_shard = o.shard;
    if (policy) o.root_shard->offload(*policy);
    o.adamw = AdamWOptions(1e-2).weight_decay(0.1);
    Job j = testing::make_sharded_model(mesh, o);
    for (int s = 0; s < 3; ++s) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + s);
      auto x = at::randn({kGlobalBatch, 7}, gen).cuda(), y = at::randn({kGlobalBatch, 5}, gen).cuda();
      testing::train_on_batch(j, x, y, 0.5);
    }
    std::vector<at::Tensor> out;
    for (const auto& unit : fsdp::testing::units(*j.root)) {
      for (auto& fp : unit->flat_params()) {
        if (policy) {
          EXPECT_TRUE(fp->sharded_param().is_cpu());
          EXPECT_TRUE(fp->working_shard().is_cuda());
          if (policy->optimizer_state() == OffloadTier::kHost) EXPECT_TRUE(fp->sharded_param().is_pinned());
        }
        out.push_back(fp->sharded_param().cpu());
      }
    }
    return at::cat(out);
  };
  const at::Tensor none = run(std::nullopt);
  const std::string dir = testing::temp_path("cuda-state-only");
  for (auto policy : {OffloadPolicy().optimizer_state(OffloadTier::kHost),
                      OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(dir)}) {
    EXPECT_TRUE(at::allclose(run(policy), none, 1e-5, 1e-6)) << offload_tier_name(policy.optimizer_state());
  }
  io::remove_tree(dir);
}

TEST(Offload, CudaStagerCopiesThroughPinnedMemory) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU: the CUDA stager's copies need one";
  auto stager = offload::make_stager(at::Device(at::kCUDA, 0));
  EXPECT_STREQ(stager->name(), "cuda");
  at::Tensor host = stager->host_zeros(4099);
  EXPECT_TRUE(host.is_pinned());
  host.copy_(at::arange(4099, at::kFloat));
  at::Tensor dev = stager->to_device(host);
  EXPECT_TRUE(dev.is_cuda());
  at::Tensor doubled = dev * 2;
  at::Tensor back = stager->to_host(doubled);
  EXPECT_TRUE(back.device().is_cpu());
  EXPECT_TRUE(at::equal(back, at::arange(4099, at::kFloat) * 2));
}

}  // namespace
}  // namespace fsdp
