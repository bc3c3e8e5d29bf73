// The runtime's rules that the planner applies besides placement (placement_test.cpp), held equal
// the same way: a model sharded on thread ranks does what the plan of its shape says.
//  - What a unit keeps after forward (resolve_reshard_after_forward, src/shard/reshard_rules.cpp,
//    then prefetch::keeps_params_after_forward): the all-gathers a step runs, on the shard group
//    and in the groups of reshard_after_forward_group, are the plan's gathers_per_step, for every
//    strategy and group size.
//  - The group sizes refused: fully_shard refuses a block's reshard_after_forward_group exactly
//    when the planner refuses the request.
//  - The disk tier's chunk (offload/tier_rules.h): the tier's chunk for the save's reads is the
//    plan's, with a memory budget and without one.
//  - The streamed step's window (offload/tier_rules.h): the window the plan counts is the rule
//    applied to the tier's own chunks, and what the step then holds, measured, stays within it.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/file_io.h"
#include "fsdp/fsdp.h"
#include "fsdp/offload.h"
#include "fsdp/plan.h"
#include "offload/tier.h"
#include "offload/tier_rules.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

constexpr int kWorld = 4;
constexpr int64_t kBatch = 8;

struct Layout {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int group = 0;            // the blocks' reshard_after_forward_group
  int shard_size = kWorld;  // a 2-D mesh of kWorld / shard_size rows when less than kWorld
};

std::string describe(const Layout& l) {
  return std::string(strategy_name(l.strategy)) + ", group " + std::to_string(l.group) + ", shard group of " +
         std::to_string(l.shard_size);
}

testing::NetOptions net_options() {
  testing::NetOptions o;
  o.in = 8, o.dim = 16, o.hidden = 24, o.out = 4, o.blocks = 3;
  return o;
}

FullyShardOptions shard_options(const Layout& l, int group, const OffloadPolicy& policy = OffloadPolicy()) {
  return FullyShardOptions()
      .strategy(l.strategy)
      .reshard_after_forward_group(group)
      .param_group([](const std::string&, const at::Tensor&) { return 0; })  // one flat param per unit
      .offload(policy);
}

PlanRequest request(const Layout& l) {
  PlanRequest r;
  r.ranks_per_node = l.shard_size;
  r.nodes = kWorld / l.shard_size;
  r.strategy = l.strategy;
  r.reshard_after_forward_group = l.group;
  r.batch_per_rank = kBatch / kWorld;
  r.micro_batch = r.batch_per_rank;  // one forward per step
  r.checkpoint_every = 0;
  r.budget = {int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40};
  return r;
}

Plan planned(testing::Net& net, const PlanRequest& r) {
  const ModelShape shape = model_shape(*net, [](const std::string& name, torch::nn::Module&) {
    return name.rfind("blocks_", 0) == 0 && name.find('.') == std::string::npos;
  });
  return plan(shape, r);
}

DeviceMesh mesh_of(const std::shared_ptr<Dist>& dist, const Layout& l) {
  return l.shard_size == kWorld ? DeviceMesh(dist) : DeviceMesh(dist, kWorld / l.shard_size, l.shard_size);
}

testing::Net sharded_net(DeviceMesh& mesh, const Layout& l, std::shared_ptr<FSDPModule>& root,
                         const OffloadPolicy& policy = OffloadPolicy()) {
  testing::Net net(net_options());
  for (auto& b : net->blocks) fully_shard(b, mesh, shard_options(l, l.group, policy));
  root = fully_shard(net, mesh, shard_options(l, 0, policy));
  return net;
}

void step(testing::Net& net, ShardedOptimizer& optim, int rank, int s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(30 + s);
  const at::Tensor x = at::randn({kBatch, 8}, gen), y = at::randn({kBatch, 4}, gen);
  const int64_t n = kBatch / kWorld;
  at::mse_loss(call(net, x.narrow(0, rank * n, n)), y.narrow(0, rank * n, n)).backward();
  optim.step();
  optim.zero_grad();
}

uint64_t all_gathers(const DeviceMesh& mesh) {
  uint64_t calls = mesh.shard_group().stats().of(CollectiveKind::kAllGather).calls;
  for (Communicator* c : mesh.groups_made_on_use()) calls += c->stats().of(CollectiveKind::kAllGather).calls;
  return calls;
}

TEST(PlanRules, TheStepRunsTheGathersThePlanCounts) {
  const std::vector<Layout> layouts{
      {ShardingStrategy::kFullShard, 0, kWorld},   {ShardingStrategy::kFullShard, 1, kWorld},
      {ShardingStrategy::kFullShard, 2, kWorld},   {ShardingStrategy::kFullShard, 4, kWorld},
      {ShardingStrategy::kShardGradOp, 0, kWorld}, {ShardingStrategy::kShardGradOp, 2, kWorld},
      {ShardingStrategy::kNoShard, 0, kWorld},     {ShardingStrategy::kHybridShard, 0, 2},
      {ShardingStrategy::kHybridShard, 2, 2}};
  for (const Layout& l : layouts) {
    testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
      at::set_num_threads(1);
      DeviceMesh mesh = mesh_of(dist, l);
      std::shared_ptr<FSDPModule> root;
      testing::Net net = sharded_net(mesh, l, root);
      const Plan p = planned(net, request(l));
      AdamW optim(root, AdamWOptions(1e-3));
      step(net, optim, dist->rank(), 0);  // records the forward order: which unit ran last
      const uint64_t before = all_gathers(mesh);
      step(net, optim, dist->rank(), 1);
      EXPECT_EQ(static_cast<int64_t>(all_gathers(mesh) - before), p.gathers_per_step) << describe(l);
    });
  }
}

TEST(PlanRules, FullyShardAndThePlannerRefuseTheSameGroupSizes) {
  int refused = 0, checked = 0;
  for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                              ShardingStrategy::kHybridShard}) {
    for (const int group : {-1, 0, 1, 2, 3, 4}) {
      const Layout l{strategy, group, strategy == ShardingStrategy::kHybridShard ? 2 : kWorld};
      bool planner = false;
      testing::Net shape_net(net_options());
      try {
        planned(shape_net, request(l));
      } catch (const ConfigError&) {
        planner = true;
      }
      testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh = mesh_of(dist, l);
        testing::Net net(net_options());
        bool runtime = false;
        try {
          fully_shard(net->blocks[0], mesh, shard_options(l, group));
        } catch (const ConfigError&) {
          runtime = true;
        }
        EXPECT_EQ(runtime, planner) << describe(l);
        if (dist->rank() == 0) refused += runtime ? 1 : 0;
      });
      ++checked;
    }
  }
  EXPECT_EQ(checked, 24);
  EXPECT_EQ(refused, 12);  // -1 everywhere, 3 on 4 ranks, 1 to 4 with NO_SHARD, 3 and 4 with HYBRID_SHARD's 2
}

// Of a disk-tier run: the tier's chunk and window under `budget` and the plan's.
struct TierSeen {
  int64_t save_reads = 0, planned_save_reads = 0;  // the save's two chunks of a state
  int64_t window = 0, planned_window = 0;          // the streamed step's window by the tier's chunks
  int64_t peak = 0;                                // measured: mapped pages and buffers, at most
};

TierSeen disk_run(const std::string& dir, int64_t budget) {
  TierSeen seen;
  const Layout l;
  const auto policy = OffloadPolicy()
                          .params(OffloadTier::kDisk)
                          .grads(OffloadTier::kDisk)
                          .optimizer_state(OffloadTier::kDisk)
                          .dir(dir)
                          .memory_budget_bytes(budget);
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    std::shared_ptr<FSDPModule> root;
    testing::Net net = sharded_net(mesh, l, root, policy);
    PlanRequest r = request(l);
    r.offload = policy;
    r.saves = true;
    const Plan p = planned(net, r);
    AdamW optim(root, AdamWOptions(1e-3));
    set_disk_tier_audit(*root, true);
    for (int s = 0; s < 2; ++s) step(net, optim, dist->rank(), s);
    if (dist->rank() != 0) return;
    const offload::DiskTier& tier = *testing::unit(*root).root_state().disk_tier;
    seen.save_reads = 2 * 4 * tier.chunk_elements(2);
    for (const auto& [name, bytes] : p.save.items) {
      if (name == "the disk tier's reads of a state (two chunks)") seen.planned_save_reads = bytes;
    }
    // Every tensor of a flat param streamed (master, gradient, AdamW's two states), at the tier's chunk.
    const int streamed = r.optimizer_state_tensors + 2;
    seen.window =
        offload::step_window(tier.budget_bytes(), streamed * offload::whole_pages(4 * tier.chunk_elements(streamed)));
    seen.planned_window = p.disk_memory_budget;
    seen.peak = disk_tier_stats(*root).peak_resident_bytes;
  });
  return seen;
}

TEST(PlanRules, TheDiskTiersChunkIsThePlans) {
  const std::string dir = testing::temp_path("plan-rules-chunk");
  for (const int64_t budget : {int64_t{0}, int64_t{30} << 20, int64_t{1} << 20}) {
    const TierSeen seen = disk_run(dir, budget);
    EXPECT_GT(seen.save_reads, 0) << "budget " << budget;
    EXPECT_EQ(seen.save_reads, seen.planned_save_reads) << "budget " << budget;
  }
  io::remove_tree(dir);
}

TEST(PlanRules, TheStreamedStepsWindowIsThePlans) {
  const std::string dir = testing::temp_path("plan-rules-window");
  for (const int64_t budget : {int64_t{0}, int64_t{30} << 20, int64_t{1} << 20}) {
    const TierSeen seen = disk_run(dir, budget);
    EXPECT_EQ(seen.window, seen.planned_window) << "budget " << budget;
    EXPECT_GT(seen.peak, 0) << "budget " << budget << ": the audit saw nothing";
    EXPECT_LE(seen.peak, seen.planned_window) << "budget " << budget;
  }
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
