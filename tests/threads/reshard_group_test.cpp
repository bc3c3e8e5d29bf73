// FullyShardOptions::reshard_after_forward_group (Note [Resharding to a group]): 4 thread ranks as
// 2 simulated nodes of 2. After forward each rank keeps half of each block's gathered params; the
// backward's all-gather runs inside the node. Bit for bit the training of reshard_after_forward
// true and false (fp32 and bf16 compute, a frozen block kept in NF4), with the bytes of each group
// counted, the parts held between forward and backward in the memory report, and the bad sizes
// refused.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "fsdp/memory.h"
#include "shard/testing.h"
#include "support/ranks.h"
#include "support/train_ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {

constexpr int kWorld = 4, kSteps = 3;
constexpr int64_t kBatch = 8;

struct Mode {
  std::optional<bool> reshard;
  int group = 0;
};

struct GroupRun {
  std::vector<std::string> prints = std::vector<std::string>(kWorld);
  std::vector<uint64_t> world_gathered = std::vector<uint64_t>(kWorld);  // bytes sent, over the whole shard group
  std::vector<uint64_t> group_gathered = std::vector<uint64_t>(kWorld);  // inside the post-forward groups
  std::vector<int64_t> held = std::vector<int64_t>(kWorld);              // gathered bytes alive after forward
  std::vector<int64_t> expected_parts = std::vector<int64_t>(kWorld);    // the blocks' 1/2 parts, by their layout
  std::vector<int64_t> expected_group = std::vector<int64_t>(kWorld);    // the blocks' group gathers, by layout
};

GroupRun train(Mode mode, std::optional<at::ScalarType> param_dtype = std::nullopt, bool frozen_nf4 = false) {
  GroupRun out;
  out.prints = testing::train_ranks(
      kWorld,
      [&](DeviceMesh& mesh, int rank) {
        testing::ShardedModelOptions o;
        o.net.in = 6, o.net.dim = 30, o.net.hidden = 50, o.net.out = 3, o.net.blocks = 3;
        o.net.device = at::kMeta;
        FullyShardOptions shard;
        shard.init(init::normal(0.3, 5));
        if (param_dtype) shard.mp_policy().param_dtype(*param_dtype);
        o.root_shard = shard;
        if (param_dtype) o.root_shard->mp_policy().output_dtype(at::kFloat);  // the loss in fp32
        if (mode.reshard) shard.reshard_after_forward(*mode.reshard);
        shard.reshard_after_forward_group(mode.group);
        if (frozen_nf4) {
          shard.frozen_storage([](const std::string&, const at::Tensor& p) {
            return p.dim() == 2 && !p.requires_grad() ? FrozenStorage::kNF4 : FrozenStorage::kParamDtype;
          });
        }
        o.shard = shard;
        testing::Net net(o.net);
        if (frozen_nf4) {
          for (auto& p : net->blocks[1]->parameters()) p.requires_grad_(false);
        }
        auto j = testing::shard_model(std::move(net), mesh, o.shard, *o.root_shard, o.adamw);
        std::vector<double> losses;
        auto collect = [](DeviceMesh& m, CollectiveKind kind) {
          uint64_t in_groups = 0;
          for (Communicator* c : m.groups_made_on_use()) in_groups += c->stats().of(kind).bytes_sent;
          return in_groups;
        };
        for (int s = 0; s < kSteps; ++s) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + s);
          const at::Tensor x = at::randn({kBatch, 6}, gen), y = at::randn({kBatch, 3}, gen);
          const int64_t n = kBatch / kWorld;
          const at::Tensor loss = at::mse_loss(fsdp::call(j.model, x.narrow(0, rank * n, n)), y.narrow(0, rank * n, n));
          if (s == kSteps - 1) out.held[rank] = memory_report(*j.root).unsharded_alive;
          loss.backward();
          clip_grad_norm(*j.root, 0.5);
          j.optim->step();
          j.optim->zero_grad();
          losses.push_back(loss.item<double>());
        }
        out.world_gathered[rank] = mesh.shard_group().stats().of(CollectiveKind::kAllGather).bytes_sent;
        out.group_gathered[rank] = collect(mesh, CollectiveKind::kAllGather);
        for (ShardedUnit* u : testing::units(*j.root)) {
          if (u->is_root()) continue;
          for (auto& fp : u->flat_params()) {
            // NF4 keeps its part as stored (the gathered stored forms of half the ranks), the rest in
            // the compute dtype.
            const int64_t part = fp->config().storage == FrozenStorage::kNF4
                                     ? fp->stored_bytes() * kWorld / 2
                                     : fp->padded_numel() / 2 * c10::elementSize(fp->config().compute_dtype);
            out.expected_parts[rank] += part;
            out.expected_group[rank] += kSteps * part;  // (2 - 1) parts sent per backward
          }
        }
        if (mode.group == 2) {
          // The group is this rank's node: ranks {0, 1} or {2, 3}.
          Communicator& g = mesh.shard_subgroup(2);
          EXPECT_EQ(g.size(), 2);
          EXPECT_EQ(g.global_rank(0), rank / 2 * 2);
          EXPECT_EQ(g.global_rank(1), rank / 2 * 2 + 1);
        }
        return testing::state_bytes(losses, *j.root, j.optim.get());
      },
      std::chrono::seconds(120));
  return out;
}

void expect_group_run(const GroupRun& plain, const GroupRun& kept, const GroupRun& group) {
  EXPECT_EQ(group.prints, plain.prints);  // losses and every state, bit for bit
  EXPECT_EQ(kept.prints, plain.prints);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(plain.group_gathered[r], 0u);
    EXPECT_EQ(static_cast<int64_t>(group.group_gathered[r]), group.expected_group[r]) << "rank " << r;
    // The backward gathers left the whole shard group: what crosses nodes is the forward's.
    EXPECT_EQ(group.world_gathered[r], kept.world_gathered[r]) << "rank " << r;
    EXPECT_LT(group.world_gathered[r], plain.world_gathered[r]) << "rank " << r;
    // Between forward and backward: the blocks' halves, beyond what true holds, below false's.
    EXPECT_EQ(group.held[r] - plain.held[r], group.expected_parts[r]) << "rank " << r;
    EXPECT_LT(group.held[r], kept.held[r]) << "rank " << r;
  }
}

TEST(ReshardGroup, BackwardGathersInsideTheNodeBitwiseAsTheBoolModes) {
  expect_group_run(train({true, 0}), train({false, 0}), train({std::nullopt, 2}));
}

TEST(ReshardGroup, Bf16ComputeAndAFrozenNf4BlockBitwise) {
  expect_group_run(train({true, 0}, at::kBFloat16, true), train({false, 0}, at::kBFloat16, true),
                   train({true, 2}, at::kBFloat16, true));
}

// 1 and the shard group's size are the bool modes.
TEST(ReshardGroup, OneIsFalseAndTheShardSizeIsTrue) {
  const GroupRun one = train({std::nullopt, 1}), whole = train({std::nullopt, kWorld});
  const GroupRun kept = train({false, 0}), plain = train({true, 0});
  EXPECT_EQ(one.prints, kept.prints);
  EXPECT_EQ(one.world_gathered, kept.world_gathered);
  EXPECT_EQ(whole.prints, plain.prints);
  EXPECT_EQ(whole.world_gathered, plain.world_gathered);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(one.group_gathered[r] + whole.group_gathered[r], 0u);
}

TEST(ReshardGroup, RefusesSizesThatDoNotFit) {
  testing::run_threads(kWorld, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto expect_refused = [&](const FullyShardOptions& o, const std::string& words) {
      testing::Net net(testing::NetOptions{});
      try {
        fully_shard(net->blocks[0], mesh, o);
        ADD_FAILURE() << "accepted: " << words;
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    expect_refused(FullyShardOptions().reshard_after_forward_group(3), "does not divide the shard group of 4 ranks");
    expect_refused(FullyShardOptions().reshard_after_forward_group(-2), "must be 0 (off) or a number of ranks");
    expect_refused(FullyShardOptions().reshard_after_forward(false).reshard_after_forward_group(2),
                   "leave reshard_after_forward unset or true");
    expect_refused(FullyShardOptions().strategy(ShardingStrategy::kNoShard).reshard_after_forward_group(2), "NO_SHARD");
  });
}

}  // namespace
}  // namespace fsdp
