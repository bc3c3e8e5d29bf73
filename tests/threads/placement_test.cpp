// The placement rulebook (offload/placement.h, Note [Placement rules]) is the runtime's and the
// planner's alike: for every offload policy and every kind of flat param (trainable, a frozen fp32
// master, a frozen base stored in bf16 or NF4), a model sharded on 2 ranks places each state in
// the tier the planner costs it in, holds the same bytes in each tier, and plans the same I/O per
// step, which is what the tiers then move (within 10%, as measured over two steps). Sizes are chosen so that no flat
// param is padded (the planner counts a unit's elements, the runtime its padded flat params), which makes the
// comparison exact.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "base/file_io.h"
#include "fsdp/fsdp.h"
#include "fsdp/offload.h"
#include "fsdp/plan.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kDim = 64;

struct Kind {
  std::string name;
  bool frozen_blocks = false;  // the blocks' weights frozen; the root's Linear stays trainable
  at::ScalarType param_dtype = at::kFloat;
  FrozenStorage storage = FrozenStorage::kParamDtype;
};

int64_t item(const PlanTier& t, const std::string& name) {
  int64_t bytes = 0;
  for (const auto& [n, b] : t.items) bytes += n == name ? b : 0;
  return bytes;
}

// Three sharded blocks and a trainable Linear of the root's own: 4,096 weights and 64 biases per
// block, 2,048 weights for the root, so 2,048, 32 and 1,024 per rank (whole NF4 blocks of 64,
// nothing padded). Frozen blocks keep their biases trainable, as a LoRA model keeps its adapters:
// every block then runs a backward.
torch::nn::Sequential make_net(const Kind& kind) {
  auto linear = [](int64_t out, bool bias) {
    return torch::nn::Linear(torch::nn::LinearOptions(kDim, out).bias(bias));
  };
  torch::nn::Sequential net(Sharded(linear(kDim, true)), Sharded(linear(kDim, true)), Sharded(linear(kDim, true)),
                            linear(32, false));
  if (kind.frozen_blocks) {
    for (size_t i = 0; i < 3; ++i) net[i]->named_parameters()["weight"].set_requires_grad(false);
  }
  return net;
}

// The kind's storage for frozen parameters; trainable ones keep fp32 masters (as LoraModel's does).
FrozenStorageFn storage_fn(const Kind& kind) {
  const FrozenStorage storage = kind.storage;
  return [storage](const std::string&, const at::Tensor& p) {
    return p.requires_grad() ? FrozenStorage::kParamDtype : storage;
  };
}

FullyShardOptions shard_options(const Kind& kind, const OffloadPolicy& policy) {
  return FullyShardOptions()
      .mp_policy(MixedPrecisionPolicy().param_dtype(kind.param_dtype).reduce_dtype(kind.param_dtype))
      .param_group([](const std::string&, const at::Tensor&) { return 0; })
      .frozen_storage(storage_fn(kind))
      .offload(policy);
}

Plan planner_view(torch::nn::Sequential& net, const Kind& kind, const OffloadPolicy& policy) {
  const ModelShape shape = model_shape(
      *net, [](const std::string& name, torch::nn::Module&) { return name.size() == 1 && name < "3"; },
      storage_fn(kind));
  PlanRequest req;
  req.ranks_per_node = kWorld;
  req.param_dtype = kind.param_dtype;
  req.reduce_dtype = kind.param_dtype;
  req.strategy = ShardingStrategy::kFullShard;
  req.offload = policy;
  req.checkpoint_every = 0;
  req.micro_batch = 1;
  req.budget = {int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40};
  return plan(shape, req);
}

void step(torch::nn::Sequential& net, ShardedOptimizer& optim, int64_t s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + s);
  const at::Tensor x = at::randn({4, kDim}, gen);
  call(net, x).to(at::kFloat).pow(2).mean().backward();
  optim.step();
  optim.zero_grad();
}

// On each of kWorld ranks: the model of `kind` sharded under `policy`, its AdamW, and the planner's
// view of the same model, handed to fn(net, root, optim, planned).
template <typename Fn>
void on_ranks(const Kind& kind, const OffloadPolicy& policy, Fn fn) {
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    auto net = make_net(kind);
    const Plan planned = planner_view(net, kind, policy);
    for (auto& block : sharded_children(*net)) fully_shard(block, mesh, shard_options(kind, policy));
    auto root = fully_shard(net, mesh, shard_options(kind, policy));
    AdamW optim(root, AdamWOptions(1e-3));
    fn(net, *root, optim, planned);
  });
}

// What the tiers move per step, measured over two steps.
OffloadIo moved_per_step(torch::nn::Sequential& net, ShardedOptimizer& optim, FSDPModule& root) {
  const OffloadIo before = offload_io(root);
  for (int s = 1; s <= 2; ++s) step(net, optim, s);
  return (offload_io(root) - before).per_step(2);
}

// Measured within 10% of planned.
void expect_near(int64_t planned, int64_t measured, const std::string& what) {
  EXPECT_LE(std::abs(static_cast<double>(measured - planned)), 0.1 * static_cast<double>(planned))
      << what << ": planned " << planned << ", measured " << measured;
}

TEST(Placement, RuntimeAndPlannerPlaceEveryStateAlike) {
  const std::string dir = testing::temp_path("placement");
  constexpr auto N = OffloadTier::kNone, H = OffloadTier::kHost, D = OffloadTier::kDisk;
  const std::vector<std::array<OffloadTier, 3>> tiers{{N, N, N}, {N, N, D}, {N, N, H}, {D, N, D},
                                                      {D, D, D}, {H, H, H}, {H, N, N}, {D, N, N}};
  const std::vector<Kind> kinds{{"trainable", false, at::kFloat, FrozenStorage::kParamDtype},
                                {"frozen fp32 masters", true, at::kFloat, FrozenStorage::kParamDtype},
                                {"frozen base in bf16", true, at::kBFloat16, FrozenStorage::kParamDtype},
                                {"frozen base in NF4", true, at::kBFloat16, FrozenStorage::kNF4}};
  int checked = 0;
  for (const auto& t : tiers) {
    for (const auto& kind : kinds) {
      const auto policy =
          OffloadPolicy().params(t[0]).grads(t[1]).optimizer_state(t[2]).dir(dir).memory_budget_bytes(64 << 20);
      const std::string what = kind.name + ", params " + offload_tier_name(t[0]) + ", grads " +
                               offload_tier_name(t[1]) + ", optimizer_state " + offload_tier_name(t[2]);
      on_ranks(kind, policy, [&](torch::nn::Sequential& net, FSDPModule& root, AdamW& optim, const Plan& planned) {
        const OffloadPlan runtime = offload_plan(root, optim);
        const PlanTier& ram = planned.device;  // on the CPU the host tier is in the same RAM
        EXPECT_EQ(runtime.device_bytes, item(ram, "sharded states not offloaded")) << what;
        EXPECT_EQ(runtime.host_bytes, item(ram, "sharded states in the host tier")) << what;
        EXPECT_EQ(runtime.disk_bytes, item(planned.disk, "sharded states in the disk tier")) << what;
        EXPECT_EQ(runtime.per_step.disk_read, planned.io_per_step.disk_read) << what;
        EXPECT_EQ(runtime.per_step.disk_write, planned.io_per_step.disk_write) << what;
        EXPECT_EQ(runtime.per_step.to_device, planned.io_per_step.to_device) << what;
        EXPECT_EQ(runtime.per_step.to_host, planned.io_per_step.to_host) << what;
        EXPECT_GT(runtime.device_bytes + runtime.host_bytes + runtime.disk_bytes, 0) << what;
        // And what the tiers then move per step, measured, is what both planned.
        step(net, optim, 0);
        const OffloadIo moved = moved_per_step(net, optim, root);
        expect_near(runtime.per_step.disk_read, moved.disk_read, what + ": disk read");
        expect_near(runtime.per_step.disk_write, moved.disk_write, what + ": disk write");
        expect_near(runtime.per_step.to_device, moved.to_device, what + ": to device");
        expect_near(runtime.per_step.to_host, moved.to_host, what + ": to host");
      });
      ++checked;
    }
  }
  EXPECT_EQ(checked, 32);
  io::remove_tree(dir);
}

// Which units keep their forward read of a disk-tier master for their backward gather is one rule
// (offload::units_keeping_forward_reads): the runtime keeps as many as fit in half the disk tier's
// memory budget, so none with the default budget (0), and the planner counts the same reads. (It
// once took every forward read as kept: one read a step where the runtime made two.)
TEST(Placement, ForwardReadsKeptAsTheRuntimeKeepsThem) {
  const std::string dir = testing::temp_path("placement-kept");
  const std::vector<Kind> kinds{{"trainable", false, at::kFloat, FrozenStorage::kParamDtype},
                                {"frozen base in NF4", true, at::kBFloat16, FrozenStorage::kNF4}};
  int checked = 0;
  for (const int64_t budget : {int64_t{0}, int64_t{64} << 20}) {
    for (const auto& kind : kinds) {
      const auto policy = OffloadPolicy().params(OffloadTier::kDisk).dir(dir).memory_budget_bytes(budget);
      const std::string what = kind.name + ", disk memory budget " + std::to_string(budget);
      on_ranks(kind, policy, [&](torch::nn::Sequential& net, FSDPModule& root, AdamW& optim, const Plan& planned) {
        step(net, optim, 0);  // the runtime chooses from the order a step recorded
        EXPECT_EQ(offload_plan(root, optim).per_step.disk_read, planned.io_per_step.disk_read) << what;
        expect_near(planned.io_per_step.disk_read, moved_per_step(net, optim, root).disk_read, what + ": disk read");
      });
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4);
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
