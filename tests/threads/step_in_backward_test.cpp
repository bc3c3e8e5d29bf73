// The optimizer step in backward (ShardedOptimizer::step_in_backward): each flat param stepped on
// the optimizer's thread as soon as the backward has its reduced gradient equals step() after
// backward bit for bit (AdamW and SGD with momentum; no offload, the disk tier with and without
// gradients on disk, the host tier, the optimizer state alone in the host or disk tier; gradient
// accumulation without sync), really steps during the backward, reads a disk-tier master once
// less per step (as offload_plan says), and refuses what it cannot honour: clipping, loss scaling,
// a second reducing backward before step(), TorchOptimizer, two optimizers in backward. A tier
// failure on the optimizer's thread reaches the caller of step().
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "base/file_io.h"
#include "fsdp/fsdp.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/offload.h"
#include "fsdp/torch_optim.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kGlobalBatch = 8;
constexpr int64_t kBudget = 3 * 3 * 1024 * 4;  // several chunks per shard, a ragged last one
// Half of it holds the forward reads of two blocks' masters (~20k floats per rank each) for their
// backward gathers (Note [Kept master reads]).
constexpr int64_t kKeepingBudget = 4 * 84 * 1024;

using Job = testing::ShardedModel;

struct Case {
  std::string name;
  std::optional<OffloadPolicy> offload;
  bool sgd = false;   // SGD with momentum and Nesterov instead of AdamW
  int64_t accum = 1;  // micro-batches per step, all but the last without gradient sync
};

// A block holds ~41k params: ~20k per rank, several chunks of the budgets below.
testing::NetOptions net_options(at::Device device) {
  testing::NetOptions o;
  o.in = 7;
  o.dim = 61;
  o.hidden = 333;
  o.out = 5;
  o.blocks = 3;
  o.device = device;
  return o;
}

Job build(DeviceMesh& mesh, const std::optional<OffloadPolicy>& offload) {
  testing::ShardedModelOptions o;
  o.net = net_options(at::kMeta);
  o.shard.init(init::normal(0.2, 11));
  o.root_shard = o.shard;
  if (offload) o.root_shard->offload(*offload);
  o.adamw = AdamWOptions(1e-2).weight_decay(0.1);
  return testing::make_sharded_model(mesh, o);
}

// One step on this rank's part of the batch; `between` runs after the backward(s), before step().
double train_step(Job& j, ShardedOptimizer& optim, const Case& setup, int64_t step, int rank,
                  const std::function<void()>& between = nullptr) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + step);
  auto x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
  const int64_t local = kGlobalBatch / kWorld, micro = local / setup.accum;
  double total = 0;
  for (int64_t m = 0; m < setup.accum; ++m) {
    j.root->set_requires_gradient_sync(m == setup.accum - 1);
    const int64_t first = rank * local + m * micro;
    at::Tensor loss = at::mse_loss(fsdp::call(j.model, x.narrow(0, first, micro)), y.narrow(0, first, micro));
    (loss / static_cast<double>(setup.accum)).backward();
    total += loss.item<double>();
  }
  if (between) between();
  optim.step();
  optim.zero_grad();
  return total;
}

// Where two fingerprints (testing::state_bytes: the losses as text lines, then the bytes of the
// params and the optimizer state) first differ.
std::string first_difference(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  const size_t line = std::count(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(i), '\n');
  return "(first difference at byte " + std::to_string(i) + " of " + std::to_string(a.size()) + ", after " +
         std::to_string(line) + " newlines; the losses come first, one line each: " + a.substr(0, a.find('\n')) +
         " vs " + b.substr(0, b.find('\n')) + ")";
}

std::unique_ptr<ShardedOptimizer> make_optimizer(Job& j, const Case& setup) {
  if (!setup.sgd) return std::move(j.optim);
  return std::make_unique<SGD>(j.root, SGDOptions(1e-2).momentum(0.9).nesterov(true).weight_decay(0.01));
}

// Trains `steps` steps on 2 thread ranks; each rank's fingerprint (losses, params, state).
std::vector<std::string> train(const Case& setup, bool in_backward, int steps,
                               const std::function<void(Job&, ShardedOptimizer&, int step)>& between = nullptr) {
  std::vector<std::string> prints(kWorld);
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, setup.offload);
        auto optim = make_optimizer(j, setup);
        optim->step_in_backward(in_backward);
        std::vector<double> losses;
        for (int s = 0; s < steps; ++s) {
          losses.push_back(train_step(j, *optim, setup, s, dist->rank(), [&] {
            if (between) between(j, *optim, s);
          }));
        }
        prints[dist->rank()] = testing::state_bytes(losses, *j.root, optim.get());
      },
      std::chrono::seconds(60));
  return prints;
}

TEST(StepInBackward, EqualsStepAfterBackwardBitwise) {
  const std::string dir = testing::temp_path("step-in-backward");
  const auto disk = OffloadPolicy()
                        .params(OffloadTier::kDisk)
                        .optimizer_state(OffloadTier::kDisk)
                        .dir(dir)
                        .memory_budget_bytes(kBudget);
  const std::vector<Case> setups{
      {"no offload", std::nullopt},
      {"disk tier", disk},
      {"disk tier, gradients too", OffloadPolicy(disk).grads(OffloadTier::kDisk).memory_budget_bytes(4 * 3 * 4096)},
      {"host tier",
       OffloadPolicy().params(OffloadTier::kHost).grads(OffloadTier::kHost).optimizer_state(OffloadTier::kHost)},
      {"state alone, host", OffloadPolicy().optimizer_state(OffloadTier::kHost)},
      {"state alone, disk", OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(dir).memory_budget_bytes(kBudget)},
      {"SGD with momentum", std::nullopt, /*sgd=*/true},
      {"disk tier, 2 micro-batches", disk, false, /*accum=*/2},
      {"disk tier, forward reads kept", OffloadPolicy(disk).memory_budget_bytes(kKeepingBudget)},
  };
  for (const auto& setup : setups) {
    const auto reference = train(setup, false, 4);
    const auto got = train(setup, true, 4, [&](Job&, ShardedOptimizer& optim, int step) {
      // Before step(): the backward has stepped the flat params whose reductions it collected
      // (every block's), and left the last ones (the root's) to step().
      int in_backward = 0, left = 0;
      for (const auto& s : optim.states()) (s.step == step + 1 ? in_backward : left) += 1;
      EXPECT_GE(in_backward, 3) << setup.name;
      EXPECT_GE(left, 1) << setup.name;
    });
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_GT(reference[r].size(), 1000u);
      EXPECT_TRUE(reference[r] == got[r]) << setup.name << ", rank " << r << ": differs from step() after backward "
                                          << first_difference(reference[r], got[r]);
    }
  }
  // Negative control: a different run does differ, so equality above means something.
  EXPECT_FALSE(train(setups[0], true, 3)[0] == train(setups[0], true, 4)[0]);
  io::remove_tree(dir);
}

// Fewer reads of a disk-tier master, each as the plan says: the step in backward takes the master
// its unit's backward all-gather read (one read less per unit gathered again in backward), and a
// budget with room keeps the forward reads of the first units of backward for their backward
// gathers (Note [Kept master reads]); the tier stays within its budget and the step in backward
// shows on its own trace lane.
TEST(StepInBackward, DiskTierReadsTheMasterOnceLessAsPlanned) {
  const std::string dir = testing::temp_path("step-in-backward-io");
  const std::string trace = testing::temp_path("step-in-backward-trace.json");
  struct Run {
    bool in_backward;
    int64_t budget;
    int64_t read = 0, written = 0;
  };
  std::vector<Run> runs{{false, kBudget}, {true, kBudget}, {false, kKeepingBudget}, {true, kKeepingBudget}};
  for (Run& run : runs) {
    const auto policy = OffloadPolicy()
                            .params(OffloadTier::kDisk)
                            .optimizer_state(OffloadTier::kDisk)
                            .dir(dir)
                            .memory_budget_bytes(run.budget);
    testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
      at::set_num_threads(1);
      DeviceMesh mesh(dist);
      Job j = build(mesh, policy);
      j.optim->step_in_backward(run.in_backward);
      auto tracer = std::make_shared<Tracer>(dist->rank());
      j.root->set_tracer(tracer);
      set_disk_tier_audit(*j.root, true);
      const auto plan = offload_plan(*j.root, *j.optim);
      const Case c{"disk", policy};
      train_step(j, *j.optim, c, 0, dist->rank());
      const auto before = offload_io(*j.root);
      constexpr int kSteps = 3;
      for (int s = 1; s <= kSteps; ++s) train_step(j, *j.optim, c, s, dist->rank());
      const auto got = (offload_io(*j.root) - before).per_step(kSteps);
      const std::string what =
          std::string(run.in_backward ? "in backward" : "after backward") + ", budget " + std::to_string(run.budget);
      EXPECT_LE(std::abs(static_cast<double>(got.disk_read - plan.per_step.disk_read)),
                0.1 * static_cast<double>(plan.per_step.disk_read))
          << what << ": planned " << plan.per_step.disk_read << " read " << got.disk_read;
      const auto stats = disk_tier_stats(*j.root);
      EXPECT_GT(stats.peak_resident_bytes, 0) << what;
      EXPECT_LE(stats.peak_resident_bytes, run.budget) << what;
      if (dist->rank() == 0) {
        run.read = got.disk_read;
        run.written = got.disk_write;
        if (run.in_backward && run.budget == kBudget) tracer->write(trace);
      }
    });
  }
  EXPECT_LT(runs[1].read, runs[0].read) << "the step in backward read the master again";
  EXPECT_LT(runs[2].read, runs[0].read) << "no forward read was kept for the backward";
  EXPECT_LT(runs[3].read, runs[1].read) << "no forward read was kept for the backward";
  EXPECT_LT(runs[3].read, runs[2].read);
  for (const Run& run : runs) EXPECT_EQ(run.written, runs[0].written);
  const std::string text = io::read_small_file(trace);
  EXPECT_NE(text.find("fsdp::step_in_backward\""), std::string::npos);
  EXPECT_NE(text.find("\"optimizer\""), std::string::npos) << "no lane of its own";
  io::remove_tree(dir);
  ::unlink(trace.c_str());
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

TEST(StepInBackward, RefusesWhatItCannotHonour) {
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    Job j = build(mesh, std::nullopt);
    j.optim->step_in_backward(true);
    const Case setup{"plain", std::nullopt};
    const int rank = dist->rank();
    // Clipping needs every gradient before any is applied.
    std::string e =
        error_of<UsageError>([&] { train_step(j, *j.optim, setup, 0, rank, [&] { clip_grad_norm(*j.root, 1.0); }); });
    EXPECT_NE(e.find("clip_grad_norm"), std::string::npos) << e;
    EXPECT_NE(e.find("step_in_backward"), std::string::npos) << e;
    j.optim->step();  // the step that clipping interrupted
    j.optim->zero_grad();
    // Loss scaling: refused before the backward.
    GradScaler scaler(j.root, GradScalerOptions().enabled(true));
    e = error_of<UsageError>([&] { scaler.scale(at::ones({}, at::kFloat)); });
    EXPECT_NE(e.find("loss scaling"), std::string::npos) << e;
    GradScaler off(j.root, GradScalerOptions().enabled(false));
    // The same two refusals up front, before any step (check_step_options).
    e = error_of<ConfigError>([&] { off.check_step_options(*j.optim, 1.0); });
    EXPECT_NE(e.find("clipping is on"), std::string::npos) << e;
    e = error_of<ConfigError>([&] { scaler.check_step_options(*j.optim, 0.0); });
    EXPECT_NE(e.find("scales the loss"), std::string::npos) << e;
    off.check_step_options(*j.optim, 0.0);  // neither: accepted
    e = error_of<UsageError>([&] { off.step(*j.optim); });
    EXPECT_NE(e.find("optim.step() directly"), std::string::npos) << e;
    // Two reducing backwards before step(): the second would step again on summed gradients.
    e = error_of<UsageError>([&] {
      for (int i = 0; i < 2; ++i) at::mse_loss(fsdp::call(j.model, at::ones({2, 7})), at::zeros({2, 5})).backward();
    });
    EXPECT_NE(e.find("reduced again before step()"), std::string::npos) << e;
    EXPECT_NE(e.find("set_requires_gradient_sync(false)"), std::string::npos) << e;
    // A second optimizer in backward on the same model; TorchOptimizer steps every shard at once.
    AdamW second(j.root, AdamWOptions(1e-3));
    e = error_of<ConfigError>([&] { second.step_in_backward(true); });
    EXPECT_NE(e.find("another optimizer"), std::string::npos) << e;
    auto torch_adam = TorchOptimizer::make<torch::optim::Adam>(j.root, torch::optim::AdamOptions(1e-3));
    e = error_of<ConfigError>([&] { torch_adam->step_in_backward(true); });
    EXPECT_NE(e.find("cannot step in backward"), std::string::npos) << e;
  });
}

// An optimizer destroyed between a backward and its step() (an exception unwound the loop) runs
// what the backward queued, on its own thread, before its subclass goes (Note [The optimizer's
// thread stops before its subclass goes]): before, a step still queued or running then was a pure
// virtual call that aborted the process (seen in RefusesWhatItCannotHonour under load).
TEST(StepInBackward, DestroyedBeforeStepRunsWhatTheBackwardQueued) {
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    Job j = build(mesh, std::nullopt);
    j.optim->step_in_backward(true);
    std::vector<at::Tensor> before;
    for (FlatParam* fp : fsdp::testing::flat_params(*j.root)) before.push_back(fp->sharded_param().clone());
    at::mse_loss(fsdp::call(j.model, at::ones({2, 7})), at::zeros({2, 5})).backward();
    j.optim.reset();
    int changed = 0;
    const auto after = fsdp::testing::flat_params(*j.root);
    for (size_t i = 0; i < after.size(); ++i) changed += at::equal(after[i]->sharded_param(), before[i]) ? 0 : 1;
    EXPECT_GT(changed, 0) << "the steps the backward queued did not run";
  });
}

// A tier failure on the optimizer's thread (here: offload.dir removed while training) reaches
// the caller of step() on the rank where it happened, naming the directory.
TEST(StepInBackward, TierFailureOnTheOptimizerThreadReachesStep) {
  const std::string dir = testing::temp_path("step-in-backward-gone");
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    const std::string mine = dir + "/rank" + std::to_string(dist->rank());
    Job j = build(mesh, OffloadPolicy()
                            .params(OffloadTier::kDisk)
                            .optimizer_state(OffloadTier::kDisk)
                            .dir(mine)
                            .memory_budget_bytes(kBudget));
    j.optim->step_in_backward(true);
    const Case setup{"disk", std::nullopt};
    train_step(j, *j.optim, setup, 0, dist->rank());
    io::remove_tree(mine);
    const std::string e = error_of<OffloadError>([&] { train_step(j, *j.optim, setup, 1, dist->rank()); });
    EXPECT_NE(e.find(mine), std::string::npos) << e;
    EXPECT_NE(e.find("is gone"), std::string::npos) << e;
  });
  io::remove_tree(dir);
}

// ZeRO-Offload's setup on a GPU: params and grads on the device, the optimizer state and fp32
// master in the host or disk tier; stepping in backward runs each unit's CPU step while the device
// computes the next units' backward, and must give what stepping after backward gives. Compiled,
// and the same schedule runs on CPU above (EqualsStepAfterBackwardBitwise, "state alone").
TEST(StepInBackward, CudaOptimizerStateAloneMatchesStepAfterBackward) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU: params and grads on a device need one";
  auto dist = Dist::single(InitOptions().device("cuda"));
  DeviceMesh mesh(dist);
  const std::string dir = testing::temp_path("cuda-step-in-backward");
  auto run = [&](const OffloadPolicy& policy, bool in_backward) {
    testing::ShardedModelOptions o;
    o.net = net_options(at::kCPU);
    o.seed = 3;
    o.move_to = at::Device(at::kCUDA, 0);
    o.root_shard = o.shard;
    o.root_shard->offload(policy);
    o.adamw = AdamWOptions(1e-2).weight_decay(0.1);
    Job j = testing::make_sharded_model(mesh, o);
    j.optim->step_in_backward(in_backward);
    for (int s = 0; s < 3; ++s) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + s);
      auto x = at::randn({kGlobalBatch, 7}, gen).cuda(), y = at::randn({kGlobalBatch, 5}, gen).cuda();
      testing::train_on_batch(j, x, y);
    }
    std::vector<at::Tensor> out;
    for (const auto& unit : fsdp::testing::units(*j.root)) {
      for (auto& fp : unit->flat_params()) {
        EXPECT_TRUE(fp->working_shard().is_cuda());
        out.push_back(fp->sharded_param().cpu());
      }
    }
    return at::cat(out);
  };
  for (auto policy : {OffloadPolicy().optimizer_state(OffloadTier::kHost),
                      OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(dir)}) {
    EXPECT_TRUE(at::allclose(run(policy, true), run(policy, false), 1e-6, 1e-7))
        << offload_tier_name(policy.optimizer_state());
  }
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
