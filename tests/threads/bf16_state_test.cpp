// AdamW's moments in bf16 (AdamWOptions::state_dtype): within a stated tolerance of fp32 state,
// half its bytes, the same bits in RAM and in the host tier, checkpoints in fp32 that resume
// bitwise and into either dtype, and the disk tier refused with a message that names the way out
// (2 thread ranks, the offload tests' model).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "offload_job.h"
#include "shard/testing.h"
#include "support/ranks.h"
#include "support/train_ranks.h"
#include "support/state.h"

namespace fsdp {
namespace {

using namespace offload_job;

Job build_with(DeviceMesh& mesh, at::ScalarType state_dtype, const std::optional<OffloadPolicy>& offload,
               double lr = 1e-2) {
  testing::ShardedModelOptions o;
  o.net = net_options(/*meta=*/true);
  o.shard.init(init::normal(0.2, 11));
  o.root_shard = o.shard;
  if (offload) o.root_shard->offload(*offload);
  o.adamw = AdamWOptions(lr).weight_decay(0.1).state_dtype(state_dtype);
  return testing::make_sharded_model(mesh, o);
}

// Every master shard of this rank, concatenated.
at::Tensor masters(Job& j) {
  std::vector<at::Tensor> parts;
  for (auto* unit : fsdp::testing::units(*j.root)) {
    for (auto& fp : unit->flat_params()) parts.push_back(fp->sharded_param().detach().to(at::kCPU).clone());
  }
  return at::cat(parts);
}

struct RunResult {
  std::vector<std::vector<double>> losses{kWorld};
  std::vector<at::Tensor> masters{kWorld};
  std::vector<std::string> prints{kWorld};
  std::vector<int64_t> state_bytes = std::vector<int64_t>(kWorld);
};

RunResult train(at::ScalarType state_dtype, int steps, const std::optional<OffloadPolicy>& offload = std::nullopt,
                double lr = 1e-2) {
  RunResult r;
  r.prints = testing::train_ranks(
      kWorld,
      [&](DeviceMesh& mesh, int rank) {
        Job j = build_with(mesh, state_dtype, offload, lr);
        for (int s = 0; s < steps; ++s) r.losses[rank].push_back(train_step(j, s, rank));
        for (const auto& st : j.optim->states()) {
          for (const auto& [name, t] : st.tensors) EXPECT_EQ(t.scalar_type(), state_dtype) << name;
        }
        r.masters[rank] = masters(j);
        r.state_bytes[rank] = j.optim->state_bytes();
        return testing::state_bytes(r.losses[rank], *j.root, j.optim.get());
      },
      std::chrono::seconds(120));
  return r;
}

// The stated tolerance: over 40 steps at lr 1e-3 the losses stay within 1% of the fp32 state's
// (measured: up to 0.3%) and the parameters within 1% of their largest magnitude (measured: 2e-4).
// (At lr 1e-2 this model's training is chaotic, a loss spike of 3x at step 2, and any perturbation
// of the update, bf16 moments or another summation order, grows without bound.)
TEST(Bf16State, StaysWithinOnePercentOfFp32StateAtHalfTheBytes) {
  const RunResult fp32 = train(at::kFloat, 40, std::nullopt, 1e-3);
  const RunResult bf16 = train(at::kBFloat16, 40, std::nullopt, 1e-3);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(bf16.state_bytes[r] * 2, fp32.state_bytes[r]) << "rank " << r;
    for (size_t s = 0; s < fp32.losses[r].size(); ++s) {
      EXPECT_NEAR(bf16.losses[r][s], fp32.losses[r][s], 0.01 * std::abs(fp32.losses[r][s])) << "step " << s;
    }
    const double scale = fp32.masters[r].abs().max().item<double>();
    const double diff = (bf16.masters[r] - fp32.masters[r]).abs().max().item<double>();
    EXPECT_LT(diff, 0.01 * scale) << "rank " << r;
    EXPECT_GT(diff, 0.0) << "rank " << r << ": the bf16 moments changed nothing";
    // The run learned: the last loss is well below the first.
    EXPECT_LT(bf16.losses[r].back(), 0.8 * bf16.losses[r].front());
  }
}

TEST(Bf16State, HostTierEqualsRamBitForBit) {
  const RunResult ram = train(at::kBFloat16, 6);
  const RunResult host = train(at::kBFloat16, 6, OffloadPolicy().optimizer_state(OffloadTier::kHost));
  EXPECT_EQ(ram.prints, host.prints);
}

TEST(Bf16State, DiskTierIsRefusedNamingTheWayOut) {
  const std::string dir = testing::temp_path("bf16-disk");
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        try {
          build_with(
              mesh, at::kBFloat16,
              OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(io::join(dir, std::to_string(dist->rank()))));
          ADD_FAILURE() << "bf16 state in the disk tier was accepted";
        } catch (const ConfigError& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("disk tier"), std::string::npos) << what;
          EXPECT_NE(what.find("OffloadPolicy::optimizer_state"), std::string::npos) << what;
        }
      },
      std::chrono::seconds(60));
  io::remove_tree(dir);
}

// A checkpoint holds the moments in fp32, so a bf16 run resumes bit for bit (the rounding's random
// bits depend on the step and the element, not on a generator), and either dtype loads it.
TEST(Bf16State, CheckpointResumesBitwiseAndIntoEitherDtype) {
  const std::string dir = testing::temp_path("bf16-ckpt");
  const std::string ckpt = io::join(dir, "ckpt");
  const RunResult straight = train(at::kBFloat16, 6);
  std::vector<std::string> resumed(kWorld);
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        const int rank = dist->rank();
        Job j = build_with(mesh, at::kBFloat16, std::nullopt);
        std::vector<double> losses;
        for (int s = 0; s < 3; ++s) losses.push_back(train_step(j, s, rank));
        checkpoint::TrainState st;
        st.step = 3;
        checkpoint::save(ckpt, "step-3", *j.root, j.optim.get(), st);
        std::vector<at::Tensor> saved;
        for (auto& s : j.optim->states()) {
          for (const auto& [name, t] : s.tensors) saved.push_back(t.to(at::kFloat));
        }
        // Into fp32 state: the bf16 values, widened exactly.
        Job wide = build_with(mesh, at::kFloat, std::nullopt);
        checkpoint::load(checkpoint::resolve(ckpt, "latest"), *wide.root, wide.optim.get());
        size_t k = 0;
        for (auto& s : wide.optim->states()) {
          for (const auto& [name, t] : s.tensors) {
            EXPECT_EQ(t.scalar_type(), at::kFloat);
            EXPECT_TRUE(at::equal(t, saved.at(k++))) << name;
          }
        }
        EXPECT_EQ(k, saved.size());
        // Into bf16 state in fresh memory: the next three steps are those of the straight run.
        Job again = build_with(mesh, at::kBFloat16, std::nullopt);
        checkpoint::load(checkpoint::resolve(ckpt, "latest"), *again.root, again.optim.get());
        for (int s = 3; s < 6; ++s) losses.push_back(train_step(again, s, rank));
        resumed[rank] = testing::state_bytes(losses, *again.root, again.optim.get());
      },
      std::chrono::seconds(120));
  EXPECT_EQ(resumed, straight.prints);
  // The files hold fp32 (the checkpoint format does not change with the state's dtype).
  std::ifstream file(io::join(io::join(ckpt, "step-3"), "optim.exp_avg.safetensors"), std::ios::binary);
  std::string header(4096, '\0');
  file.read(header.data(), static_cast<std::streamsize>(header.size()));
  EXPECT_NE(header.find("\"F32\""), std::string::npos);
  EXPECT_EQ(header.find("\"BF16\""), std::string::npos);
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
