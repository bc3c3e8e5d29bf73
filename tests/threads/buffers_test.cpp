// Buffers of a sharded model: BatchNorm's running statistics kept consistent across ranks that see
// different data (broadcast, average) or left local; non-persistent buffers left alone; the
// buffer_dtype cast; buffers saved next to the parameters and restored on any world size, a
// resumed run ending with the uninterrupted run's buffers and losses; buffers whose shapes differ
// across ranks refused on every rank naming the buffer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <mutex>

#include "base/file_io.h"
#include "fsdp/fsdp.h"
#include "safetensors/safetensors.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

std::mutex g_seed_mutex;

torch::nn::Sequential make_mlp() {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(3);
  return torch::nn::Sequential(Sharded(torch::nn::Linear(6, 8)), torch::nn::BatchNorm1d(8), torch::nn::ReLU(),
                               Sharded(torch::nn::Linear(8, 2)));
}

// Rank-specific data: each rank's batch differs.
std::pair<at::Tensor, at::Tensor> data(int rank, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + 10 * step + rank);
  auto x = at::randn({4, 6}, gen) + rank, y = at::randn({4, 2}, gen);
  return {x, y};
}

struct TrainRun {
  torch::nn::Sequential net{nullptr};
  std::shared_ptr<FSDPModule> root;
  std::unique_ptr<ShardedOptimizer> optim;
};

TrainRun make_run(DeviceMesh& mesh, const BufferPolicy& buffers, const MixedPrecisionPolicy& mp = {}) {
  TrainRun r;
  r.net = make_mlp();
  for (auto& block : sharded_children(*r.net)) fully_shard(block, mesh);
  r.root = fully_shard(r.net, mesh, FullyShardOptions().buffers(buffers).mp_policy(mp));
  r.optim = TorchOptimizer::make<torch::optim::Adam>(r.root, torch::optim::AdamOptions(1e-2));
  return r;
}

double step(TrainRun& r, int rank, int i) {
  auto [x, y] = data(rank, i);
  auto loss = at::mse_loss(fsdp::call(r.net, x), y);
  loss.backward();
  r.optim->step();
  r.optim->zero_grad();
  return loss.item<double>();
}

at::Tensor running_mean(TrainRun& r) { return r.net->named_buffers()["1.running_mean"].detach().clone(); }

// Every rank's copy of `t`, gathered.
at::Tensor gathered(const std::shared_ptr<Dist>& dist, const at::Tensor& t) {
  auto all = at::empty({dist->world_size() * t.numel()}, t.options());
  dist->world().all_gather(all, t.reshape({-1}).contiguous(), "test").wait();
  return all.reshape({dist->world_size(), -1});
}

TEST(Buffers, BroadcastKeepsRanksEqualAverageIsTheMeanLocalDiffers) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    for (auto sync : {BufferSync::kBroadcast, BufferSync::kAverage, BufferSync::kLocal}) {
      TrainRun r = make_run(mesh, BufferPolicy().sync(sync));
      // The reference: the same model unsharded on this rank's data alone, one forward.
      auto ref = make_mlp();
      auto [x, y] = data(dist->rank(), 0);
      ref->forward(x);
      step(r, dist->rank(), 0);
      auto mine = running_mean(r);
      auto all = gathered(dist, mine);
      auto local = ref->named_buffers()["1.running_mean"].detach();
      auto locals = gathered(dist, local);
      EXPECT_GT(mine.abs().sum().item<double>(), 0) << buffer_sync_name(sync);
      switch (sync) {
        case BufferSync::kBroadcast: EXPECT_TRUE(at::allclose(mine, locals[0], 1e-5, 1e-6)); break;
        case BufferSync::kAverage: EXPECT_TRUE(at::allclose(mine, locals.mean(0), 1e-5, 1e-6)); break;
        case BufferSync::kLocal: EXPECT_TRUE(at::allclose(mine, local, 1e-5, 1e-6)); break;
      }
      if (sync == BufferSync::kLocal) {
        EXPECT_FALSE(at::allclose(all[0], all[1]));
      } else {
        EXPECT_TRUE(at::equal(all[0], all[1])) << buffer_sync_name(sync);
        // num_batches_tracked (an integer counter) agrees too.
        auto n = gathered(dist, r.net->named_buffers()["1.num_batches_tracked"].detach().clone());
        EXPECT_TRUE(at::equal(n[0], n[1]));
      }
    }
  });
}

TEST(Buffers, NonPersistentIsLeftAlone) {
  const std::string dir = testing::temp_path("buffers_np");
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TrainRun r = make_run(mesh, BufferPolicy().non_persistent({"1.running_var"}));
    step(r, dist->rank(), 0);
    auto bufs = r.net->named_buffers();
    auto var = gathered(dist, bufs["1.running_var"].detach().clone());
    EXPECT_FALSE(at::allclose(var[0], var[1]));  // nor synchronised
    checkpoint::save(dir, "s1", *r.root, r.optim.get(), {});
    // A bad name is a clear error.
    auto bad = make_mlp();
    for (auto& block : sharded_children(*bad)) fully_shard(block, mesh);
    auto bad_root = fully_shard(bad, mesh, FullyShardOptions().buffers(BufferPolicy().non_persistent({"1.nope"})));
    try {
      fsdp::call(bad, data(dist->rank(), 0).first);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("1.nope"), std::string::npos) << e.what();
    }
  });
  // Saved under module names; the non-persistent one is not saved.
  auto header = safetensors::read_header(dir + "/s1/model.safetensors");
  ASSERT_NE(header.find("1.running_mean"), nullptr);
  EXPECT_EQ(header.find("1.running_mean")->dtype, safetensors::DType::F32);
  EXPECT_EQ(header.find("1.num_batches_tracked")->dtype, safetensors::DType::I64);
  EXPECT_EQ(header.find("1.running_var"), nullptr);
  EXPECT_NE(header.find("0.weight"), nullptr);
}

// Save at step 2 of 4, resume in fresh models: the resumed steps' losses and the final buffers
// (and an eval-mode loss, which reads the running statistics) equal the uninterrupted run's.
// Then load on one rank: the buffers land whole.
TEST(Buffers, SaveAndResumeGiveTheUninterruptedRun) {
  const std::string dir = testing::temp_path("buffers_resume");
  std::vector<std::vector<double>> straight(2), resumed(2);
  std::vector<at::Tensor> straight_mean(2), resumed_mean(2);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    const int rank = dist->rank();
    {
      TrainRun r = make_run(mesh, {});
      for (int i = 0; i < 4; ++i) {
        straight[rank].push_back(step(r, rank, i));
        if (i == 1) checkpoint::save(dir, "step-2", *r.root, r.optim.get(), {});
      }
      r.net->eval();
      straight[rank].push_back(
          at::mse_loss(fsdp::call(r.net, data(rank, 9).first), data(rank, 9).second).item<double>());
      straight_mean[rank] = running_mean(r);
    }
    {
      TrainRun r = make_run(mesh, {});
      checkpoint::load(dir + "/step-2", *r.root, r.optim.get());
      for (int i = 2; i < 4; ++i) resumed[rank].push_back(step(r, rank, i));
      r.net->eval();
      resumed[rank].push_back(
          at::mse_loss(fsdp::call(r.net, data(rank, 9).first), data(rank, 9).second).item<double>());
      resumed_mean[rank] = running_mean(r);
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    for (int i = 0; i < 3; ++i)
      EXPECT_DOUBLE_EQ(resumed[rank][i], straight[rank][i + 2]) << "rank " << rank << " i " << i;
    EXPECT_TRUE(at::equal(resumed_mean[rank], straight_mean[rank]));
  }
  // One rank reads the 2-rank checkpoint: the buffers are the saved ones.
  testing::run_threads(1, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TrainRun r = make_run(mesh, {});
    checkpoint::load(checkpoint::resolve(dir, "latest"), *r.root, r.optim.get());
    auto unsharded = make_mlp();
    checkpoint::load_unsharded(dir + "/step-2", *unsharded);
    EXPECT_TRUE(at::equal(running_mean(r), unsharded->named_buffers()["1.running_mean"]));
    EXPECT_GT(r.net->named_buffers()["1.num_batches_tracked"].item<int64_t>(), 0);
  });
}

// A module with a buffer of its own (its shape set per rank in the mismatch test).
class OddImpl : public torch::nn::Module {
 public:
  explicit OddImpl(int64_t n) : fc(register_module("fc", torch::nn::Linear(3, 3))) {
    register_buffer("stat", at::zeros({n}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Odd);

// MixedPrecisionPolicy::buffer_dtype casts persistent buffers; checkpoints keep the original dtype.
TEST(Buffers, BufferDtypeCastsAndSavesTheOriginalDtype) {
  const std::string dir = testing::temp_path("buffers_dtype");
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Odd net(3);
    {
      c10::NoGradGuard ng;
      net->named_buffers()["stat"].fill_(0.5 + dist->rank());  // rank 0's value wins
    }
    auto root = fully_shard(net, mesh, FullyShardOptions().mp_policy(MixedPrecisionPolicy().buffer_dtype(at::kDouble)));
    fsdp::call(net, at::ones({2, 3})).sum().backward();
    auto stat = net->named_buffers()["stat"];
    EXPECT_EQ(stat.scalar_type(), at::kDouble);
    EXPECT_TRUE(at::equal(stat, at::full({3}, 0.5, at::kDouble)));
    checkpoint::save(dir, "s", *root, nullptr, {});
  });
  auto header = safetensors::read_header(dir + "/s/model.safetensors");
  ASSERT_NE(header.find("stat"), nullptr);
  EXPECT_EQ(header.find("stat")->dtype, safetensors::DType::F32);
}

TEST(Buffers, ShapesThatDifferAcrossRanksAreAnErrorOnEveryRank) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Odd net(3 + dist->rank());
    auto root = fully_shard(net, mesh);
    try {
      fsdp::call(net, at::ones({2, 3}));
      ADD_FAILURE() << "rank " << dist->rank() << ": no error";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'stat'"), std::string::npos) << what;
      EXPECT_NE(what.find("[3]"), std::string::npos) << what;
      EXPECT_NE(what.find("[4]"), std::string::npos) << what;
    }
  });
}

}  // namespace
}  // namespace fsdp
