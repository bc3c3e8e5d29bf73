// Stock torch::optim optimizers stepping a sharded model: parity with the same optimizer over the
// unsharded model (SGD with momentum and weight decay, Adam, AdamW with amsgrad, RMSprop centered
// with momentum, Adagrad), group options and lr changes, sharded state saved and restored in
// checkpoints (a resumed run equals the uninterrupted one), and optimizers that cannot step flat
// shards refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <mutex>

#include "fsdp/fsdp.h"
#include "support/models.h"
#include "support/ranks.h"

namespace fsdp {
namespace {
using testing::Net;
using testing::NetOptions;

std::mutex g_seed_mutex;

Net make_net() {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(17);
  return Net(NetOptions());
}

std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  NetOptions o;
  return {at::randn({8, o.in}, gen), at::randn({8, o.out}, gen)};
}

using MakeSharded = std::function<std::unique_ptr<TorchOptimizer>(const std::shared_ptr<FSDPModule>&)>;
using MakeRef = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

template <typename O, typename Options>
std::pair<MakeSharded, MakeRef> pair_of(const Options& o) {
  return {[o](const std::shared_ptr<FSDPModule>& root) { return TorchOptimizer::make<O>(root, o); },
          [o](std::vector<at::Tensor> params) { return std::make_unique<O>(std::move(params), o); }};
}

Net shard(DeviceMesh& mesh, std::shared_ptr<FSDPModule>& root) {
  Net net = make_net();
  for (auto& b : net->blocks) fully_shard(b, mesh);
  root = fully_shard(net, mesh);
  return net;
}

double sharded_step(const std::shared_ptr<Dist>& dist, Net& net, TorchOptimizer& optim, int step) {
  auto [x, y] = global_batch(step);
  const int64_t n = 8 / dist->world_size();
  auto loss = at::mse_loss(fsdp::call(net, x.narrow(0, dist->rank() * n, n)), y.narrow(0, dist->rank() * n, n));
  loss.backward();
  optim.step();
  optim.zero_grad();
  auto l = loss.detach().to(at::kDouble).reshape({1});
  dist->world().all_reduce(l, ReduceOp::kAvg, "loss").wait();
  return l.item<double>();
}

TEST(TorchOptim, ParityWithTheUnshardedModel) {
  std::vector<std::pair<std::string, std::pair<MakeSharded, MakeRef>>> cases = {
      {"SGD",
       pair_of<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01).nesterov(true))},
      {"Adam", pair_of<torch::optim::Adam>(torch::optim::AdamOptions(1e-2).weight_decay(0.01))},
      {"AdamW", pair_of<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).amsgrad(true))},
      {"RMSprop", pair_of<torch::optim::RMSprop>(torch::optim::RMSpropOptions(1e-3).momentum(0.5).centered(true))},
      {"Adagrad", pair_of<torch::optim::Adagrad>(
                      torch::optim::AdagradOptions(0.05).lr_decay(0.01).initial_accumulator_value(0.1))},
  };
  for (const auto& [name, makers] : cases) {
    testing::run_threads(2, [&, name = name, makers = makers](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      std::shared_ptr<FSDPModule> root;
      Net net = shard(mesh, root);
      auto optim = makers.first(root);
      Net ref = make_net();
      auto ref_optim = makers.second(ref->parameters());
      for (int step = 0; step < 5; ++step) {
        if (step == 2) {  // an lr change mid-run, on both
          optim->set_lr(optim->lr() * 0.5);
          for (auto& g : ref_optim->param_groups()) g.options().set_lr(g.options().get_lr() * 0.5);
        }
        const double loss = sharded_step(dist, net, *optim, step);
        auto [x, y] = global_batch(step);
        auto ref_loss = at::mse_loss(ref->forward(x), y);
        ref_loss.backward();
        ref_optim->step();
        ref_optim->zero_grad();
        EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5 * std::abs(loss) + 1e-7) << name << " step " << step;
      }
      EXPECT_EQ(optim->type_name(), "torch::optim::" + name);
      EXPECT_GT(optim->state_bytes(), 0) << name;
    });
  }
}

// Save at step 2, resume in fresh processes' worth of objects: the same losses as running on.
TEST(TorchOptim, CheckpointResumesExactly) {
  const std::string dir = testing::temp_path("torch_optim_ckpt");
  std::vector<double> straight, resumed;
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    const auto opts = torch::optim::RMSpropOptions(1e-2).momentum(0.5).centered(true);
    {
      std::shared_ptr<FSDPModule> root;
      Net net = shard(mesh, root);
      auto optim = TorchOptimizer::make<torch::optim::RMSprop>(root, opts);
      for (int step = 0; step < 4; ++step) {
        const double l = sharded_step(dist, net, *optim, step);
        if (dist->rank() == 0) straight.push_back(l);
        if (step == 1) checkpoint::save(dir, "step-2", *root, optim.get(), {});
      }
    }
    std::shared_ptr<FSDPModule> root;
    Net net = shard(mesh, root);
    auto optim = TorchOptimizer::make<torch::optim::RMSprop>(root, opts);
    checkpoint::load(dir + "/step-2", *root, optim.get());
    for (int step = 2; step < 4; ++step) {
      const double l = sharded_step(dist, net, *optim, step);
      if (dist->rank() == 0) resumed.push_back(l);
    }
    // A checkpoint of another optimizer type is refused.
    auto adam = TorchOptimizer::make<torch::optim::Adam>(root, torch::optim::AdamOptions());
    EXPECT_THROW(checkpoint::load(dir + "/step-2", *root, adam.get()), CheckpointError);
  });
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_DOUBLE_EQ(resumed[0], straight[2]);
  EXPECT_DOUBLE_EQ(resumed[1], straight[3]);
}

// LBFGS needs whole parameters: refused on every rank with a clear error; so is state offload.
TEST(TorchOptim, UnsupportedOptimizersAreRefused) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    std::shared_ptr<FSDPModule> root;
    Net net = shard(mesh, root);
    try {
      TorchOptimizer::make<torch::optim::LBFGS>(root, torch::optim::LBFGSOptions(1));
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("LBFGS"), std::string::npos) << what;
      EXPECT_NE(what.find("element-wise"), std::string::npos) << what;
    }
  });
}

}  // namespace
}  // namespace fsdp
