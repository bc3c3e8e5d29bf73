// What a newcomer trips on, refused with errors that say what to do: a stock torch::optim
// optimizer (or torch::nn::utils::clip_grad_norm_) over the original parameters of a sharded model
// fails on its first use of a gradient, naming fsdp::TorchOptimizer::make / fsdp::clip_grad_norm,
// on every path (FULL_SHARD, NO_SHARD, one rank in fp32, accumulation without sync), while
// zero_grad over those parameters stays harmless and correct programs train bit for bit as
// before; reading a weight between steps names unshard/reshard and checkpoints, and the first
// gives the unsharded model's trained weight; errors name modules by their paths (a parameter tied across two
// units, a unit run before its root, a child sharded after its parent, a module registered at two
// paths); and an optimizer step with no gradient since zero_grad is a UsageError on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim.h>

#include <functional>
#include <mutex>
#include <utility>

#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/usage_error.h"

namespace fsdp {
namespace {
using testing::Dense;
using testing::Net;
using testing::NetOptions;

std::mutex g_seed_mutex;

Net make_net() {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(23);
  return Net(NetOptions());
}

std::pair<at::Tensor, at::Tensor> batch(const std::shared_ptr<Dist>& dist, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  NetOptions o;
  auto x = at::randn({8, o.in}, gen), y = at::randn({8, o.out}, gen);
  const int64_t n = 8 / dist->world_size();
  return {x.narrow(0, dist->rank() * n, n), y.narrow(0, dist->rank() * n, n)};
}

Net shard(DeviceMesh& mesh, std::shared_ptr<FSDPModule>& root, ShardingStrategy strategy) {
  Net net = make_net();
  const auto opts = FullyShardOptions().strategy(strategy);
  for (auto& b : net->blocks) fully_shard(b, mesh, opts);
  root = fully_shard(net, mesh, opts);
  return net;
}

// This rank's master shards, concatenated.
at::Tensor masters(FSDPModule& root) {
  std::vector<at::Tensor> out;
  for (auto* unit : testing::units(root)) {
    for (const auto& fp : unit->flat_params()) out.push_back(fp->sharded_param().clone());
  }
  return at::cat(out);
}

using testing::usage_error_of;

using MakeOptim = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

struct OptimCase {
  std::string name;
  MakeOptim make;
  bool scales_params_first = false;  // AdamW's decoupled weight decay runs before it reads a gradient
};

std::vector<OptimCase> optim_cases() {
  namespace o = torch::optim;
  auto of = [](auto options, auto* tag) -> MakeOptim {
    using O = std::remove_pointer_t<decltype(tag)>;
    return [options](std::vector<at::Tensor> p) { return std::make_unique<O>(std::move(p), options); };
  };
  return {
      {"SGD", of(o::SGDOptions(0.1), static_cast<o::SGD*>(nullptr))},
      {"SGD momentum+decay", of(o::SGDOptions(0.1).momentum(0.9).weight_decay(0.01), static_cast<o::SGD*>(nullptr))},
      {"Adam", of(o::AdamOptions(1e-2), static_cast<o::Adam*>(nullptr))},
      {"AdamW", of(o::AdamWOptions(1e-2), static_cast<o::AdamW*>(nullptr)), true},
      {"RMSprop", of(o::RMSpropOptions(1e-2).momentum(0.5), static_cast<o::RMSprop*>(nullptr))},
      {"Adagrad", of(o::AdagradOptions(1e-2), static_cast<o::Adagrad*>(nullptr))}};
}

// Every stock optimizer over net->parameters() fails with UsageError naming
// fsdp::TorchOptimizer::make, at its construction (Adagrad reads the guarded parameters) or its
// first step, on 2 ranks with FULL_SHARD and NO_SHARD; the masters are untouched (but by AdamW's
// decay where the parameters are the masters), and the model then trains with TorchOptimizer.
void check_optimizers_refused(const std::shared_ptr<Dist>& dist, ShardingStrategy strategy) {
  DeviceMesh mesh(dist);
  std::shared_ptr<FSDPModule> root;
  Net net = shard(mesh, root, strategy);
  const bool params_are_masters = strategy == ShardingStrategy::kNoShard || dist->world_size() == 1;
  for (const auto& c : optim_cases()) {
    auto [x, y] = batch(dist, 0);
    at::mse_loss(fsdp::call(net, x), y).backward();
    const at::Tensor before = masters(*root);
    const std::string what = usage_error_of([&] {
      auto optim = c.make(net->parameters());
      optim->step();
    });
    EXPECT_NE(what.find("fsdp::TorchOptimizer::make"), std::string::npos) << c.name << ": " << what;
    if (!(c.scales_params_first && params_are_masters)) {
      EXPECT_TRUE(at::equal(before, masters(*root))) << c.name;
    }
  }
  auto optim = TorchOptimizer::make<torch::optim::Adam>(root, torch::optim::AdamOptions(1e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 6; ++step) {
    auto [x, y] = batch(dist, 1);
    auto loss = at::mse_loss(fsdp::call(net, x), y);
    loss.backward();
    optim->step();
    optim->zero_grad();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
}

TEST(TorchOptimOnParameters, EveryOptimizerRefusedFullShard) {
  testing::run_threads(
      2, [](const std::shared_ptr<Dist>& dist) { check_optimizers_refused(dist, ShardingStrategy::kFullShard); });
}

TEST(TorchOptimOnParameters, EveryOptimizerRefusedNoShard) {
  testing::run_threads(
      2, [](const std::shared_ptr<Dist>& dist) { check_optimizers_refused(dist, ShardingStrategy::kNoShard); });
}

// One rank in fp32: the parameters are views of the masters, never guarded; the gradient is.
TEST(TorchOptimOnParameters, OneRankFp32Refused) {
  testing::run_threads(
      1, [](const std::shared_ptr<Dist>& dist) { check_optimizers_refused(dist, ShardingStrategy::kFullShard); });
}

// LBFGS: its closure runs the sharded forward and backward, then it reads the gradients.
TEST(TorchOptimOnParameters, LbfgsRefused) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    std::shared_ptr<FSDPModule> root;
    Net net = shard(mesh, root, ShardingStrategy::kFullShard);
    torch::optim::LBFGS lbfgs(net->parameters(), torch::optim::LBFGSOptions(0.1));
    auto [x, y] = batch(dist, 0);
    const std::string what = usage_error_of([&] {
      lbfgs.step([&] {
        lbfgs.zero_grad();
        auto loss = at::mse_loss(fsdp::call(net, x), y);
        loss.backward();
        return loss;
      });
    });
    EXPECT_NE(what.find("fsdp::TorchOptimizer::make"), std::string::npos) << what;
  });
}

// torch::nn::utils::clip_grad_norm_ over the parameters points to fsdp::clip_grad_norm.
TEST(TorchOptimOnParameters, ClipGradNormRefused) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      std::shared_ptr<FSDPModule> root;
      Net net = shard(mesh, root, strategy);
      auto [x, y] = batch(dist, 0);
      at::mse_loss(fsdp::call(net, x), y).backward();
      const std::string what = usage_error_of([&] { torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0); });
      EXPECT_NE(what.find("fsdp::clip_grad_norm"), std::string::npos) << what;
      EXPECT_NE(what.find("'inp.weight'"), std::string::npos) << what;  // the parameter, by its path
      EXPECT_GT(clip_grad_norm(*root, 1.0), 0.0);
    }
  });
}

// Reading a weight between steps is refused with the two ways to read it: gathering its unit
// (unshard, read, reshard), which gives the trained full weight, equal to the unsharded model's,
// or a checkpoint.
TEST(ReadingWeights, BetweenStepsNamesUnshardAndCheckpoints) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    std::shared_ptr<FSDPModule> root;
    Net net = shard(mesh, root, ShardingStrategy::kFullShard);
    auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.1));
    auto [x, y] = batch(dist, 0);
    at::mse_loss(fsdp::call(net, x), y).backward();
    optim->step();
    const std::string what = usage_error_of([&] { (void)net->inp->weight.sum(); });
    EXPECT_NE(what.find("unshard()"), std::string::npos) << what;
    EXPECT_NE(what.find("reshard()"), std::string::npos) << what;
    EXPECT_NE(what.find("fsdp::load_unsharded"), std::string::npos) << what;
    EXPECT_NE(what.find("'inp.weight'"), std::string::npos) << what;

    root->unshard();
    const at::Tensor got = net->inp->weight.clone();
    root->reshard();
    EXPECT_FALSE(usage_error_of([&] { (void)net->inp->weight.sum(); }).empty());  // sharded again

    Net ref = make_net();  // the same step on the whole batch, unsharded
    torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(0.1));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(700);
    NetOptions o;
    auto X = at::randn({8, o.in}, gen), Y = at::randn({8, o.out}, gen);
    at::mse_loss(ref->forward(X), Y).backward();
    sgd.step();
    ASSERT_EQ(got.sizes(), ref->inp->weight.sizes());
    EXPECT_TRUE(at::allclose(got, ref->inp->weight, 1e-5, 1e-6)) << (got - ref->inp->weight).abs().max();
  });
}

// Training with fsdp's optimizer, accumulating 2 micro-batches without sync. `meddle` also
// clears the parameters' gradients through Module::zero_grad and a torch::optim optimizer's
// zero_grad (set_to_none true and false: harmless) and tries a torch::optim step after every
// backward (refused): the result is bit for bit that of the plain run.
at::Tensor accumulate(const std::shared_ptr<Dist>& dist, bool meddle) {
  DeviceMesh mesh(dist);
  std::shared_ptr<FSDPModule> root;
  Net net = shard(mesh, root, ShardingStrategy::kFullShard);
  auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD stock(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      root->set_requires_gradient_sync(micro == 1);
      auto [x, y] = batch(dist, step * 2 + micro);
      at::mse_loss(fsdp::call(net, x), y).backward();
      if (!meddle) continue;
      const std::string what = usage_error_of([&] { stock.step(); });
      EXPECT_NE(what.find("fsdp::TorchOptimizer::make"), std::string::npos) << what;
      stock.zero_grad(/*set_to_none=*/micro == 1);
      net->zero_grad(/*set_to_none=*/micro == 0);
    }
    optim->step();
    optim->zero_grad();
  }
  return masters(*root);
}

TEST(TorchOptimOnParameters, ZeroGradHarmlessAndAccumulationBitwiseUnchanged) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    const at::Tensor plain = accumulate(dist, false);
    const at::Tensor meddled = accumulate(dist, true);
    EXPECT_TRUE(at::equal(plain, meddled));
  });
}

// ---- errors name module paths

// A root with a trunk and two heads that share one weight (heads.main and heads.aux).
class HeadsImpl : public torch::nn::Module {
 public:
  HeadsImpl() : main(register_module("main", Dense(6, 6))), aux(register_module("aux", Dense(main->weight, 6))) {}
  at::Tensor forward(const at::Tensor& h) { return fsdp::call(main, h) + fsdp::call(aux, h).tanh(); }
  Dense main, aux;
};
TORCH_MODULE(Heads);

class TiedNetImpl : public torch::nn::Module {
 public:
  TiedNetImpl() : trunk(register_module("trunk", Dense(6, 6))), heads(register_module("heads", Heads())) {}
  at::Tensor forward(const at::Tensor& x) { return fsdp::call(heads, at::tanh(fsdp::call(trunk, x))); }
  Dense trunk;
  Heads heads;
};
TORCH_MODULE(TiedNet);

std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError";
  return "";
}

TEST(ErrorPaths, ParameterTiedAcrossUnitsNamesBothPathsAndTheParent) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto x = at::ones({2, 6});
    {  // each user of the tied weight its own unit: refused at the root's first call
      TiedNet net;
      fully_shard(net->trunk, mesh);
      fully_shard(net->heads->main, mesh);
      fully_shard(net->heads->aux, mesh);
      auto root = fully_shard(net, mesh);
      const std::string what = config_error_of([&] { fsdp::call(net, x); });
      EXPECT_NE(what.find("'heads.aux.weight' (unit 'heads.aux')"), std::string::npos) << what;
      EXPECT_NE(what.find("'heads.main.weight' (unit 'heads.main')"), std::string::npos) << what;
      EXPECT_NE(what.find("common parent 'heads'"), std::string::npos) << what;
      EXPECT_EQ(what.find("bottom-up"), std::string::npos) << what;
      EXPECT_EQ(what.find("Impl"), std::string::npos) << what;  // paths, not C++ types
    }
    {  // one user in the root's own parameters, the other its own unit
      TiedNet net;
      fully_shard(net->heads->aux, mesh);
      auto root = fully_shard(net, mesh);
      const std::string what = config_error_of([&] { fsdp::call(net, x); });
      EXPECT_NE(what.find("'heads.main.weight' (unit '<root>')"), std::string::npos) << what;
      EXPECT_NE(what.find("'heads.aux.weight' (unit 'heads.aux')"), std::string::npos) << what;
      EXPECT_NE(what.find("not 'heads.aux' on its own"), std::string::npos) << what;
    }
    {  // the fix the message gives: the common parent as one unit
      TiedNet net;
      fully_shard(net->trunk, mesh);
      fully_shard(net->heads, mesh);
      auto root = fully_shard(net, mesh);
      auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.1));
      auto loss = fsdp::call(net, x).pow(2).mean();
      loss.backward();
      optim->step();
      EXPECT_TRUE(std::isfinite(loss.item<double>()));
    }
  });
}

TEST(ErrorPaths, UnitRunBeforeItsRootAndShardedTwiceByPath) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TiedNet net;
    fully_shard(net->trunk, mesh);
    fully_shard(net->heads, mesh);
    auto root = fully_shard(net, mesh);
    const std::string early = usage_error_of([&] { fsdp::call(net->heads, at::ones({2, 6})); });
    EXPECT_NE(early.find("sharded module 'heads' ("), std::string::npos) << early;
    EXPECT_NE(early.find("HeadsImpl) ran before its root"), std::string::npos) << early;
    const std::string twice = config_error_of([&] { fully_shard(net->trunk, mesh); });
    EXPECT_NE(twice.find("module 'trunk'"), std::string::npos) << twice;
    const std::string child = config_error_of([&] { fully_shard(net->heads->main, mesh); });
    EXPECT_NE(child.find("cannot shard 'heads.main': its parameter 'heads.main.weight' already belongs to the unit of "
                         "'heads'"),
              std::string::npos)
        << child;
    EXPECT_NE(child.find("bottom-up"), std::string::npos) << child;
  });
}

// ---- an optimizer step with no gradient (Note [A step needs a gradient] in src/optim/optim.cpp)

std::string step_error(ShardedOptimizer& optim) {
  const std::string what = usage_error_of([&] { optim.step(); });
  EXPECT_NE(what.find(".step() with no gradient reduced since the last zero_grad()"), std::string::npos) << what;
  EXPECT_NE(what.find("Run loss.backward() before each step()"), std::string::npos) << what;
  return what;
}

// The first step, a step after zero_grad, and a step after micro-batches that all skipped the
// gradient sync are each a UsageError on every rank that changes neither the params nor the state;
// with step_in_backward too. A backward whose last micro-batch syncs steps as before.
TEST(StepWithoutGradient, IsAUsageErrorOnEveryRankAndChangesNothing) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    for (bool in_backward : {false, true}) {
      std::shared_ptr<FSDPModule> root;
      Net net = shard(mesh, root, ShardingStrategy::kFullShard);
      AdamW optim(root, AdamWOptions(1e-2).weight_decay(0.1));
      optim.step_in_backward(in_backward);
      const at::Tensor start = masters(*root);
      step_error(optim);
      EXPECT_TRUE(at::equal(masters(*root), start));
      for (const auto& s : std::as_const(optim).states()) EXPECT_EQ(s.step, 0) << s.tag;
      auto [x, y] = batch(dist, 0);
      at::mse_loss(fsdp::call(net, x), y).backward();
      optim.step();
      optim.zero_grad();
      const at::Tensor stepped = masters(*root);
      EXPECT_FALSE(at::equal(stepped, start));
      step_error(optim);  // a second step() with no backward since zero_grad
      EXPECT_TRUE(at::equal(masters(*root), stepped));
      for (const auto& s : std::as_const(optim).states()) EXPECT_EQ(s.step, 1) << s.tag;
      root->set_requires_gradient_sync(false);  // accumulation: these micro-batches reduce nothing
      at::mse_loss(fsdp::call(net, x), y).backward();
      if (!in_backward) step_error(optim);
      root->set_requires_gradient_sync(true);  // the last one does
      at::mse_loss(fsdp::call(net, x), y).backward();
      optim.step();
      optim.zero_grad();
      EXPECT_FALSE(at::equal(masters(*root), stepped));
      for (const auto& s : std::as_const(optim).states()) EXPECT_EQ(s.step, 2) << s.tag;
    }
  });
}

// TorchOptimizer refuses the same; a model with nothing trainable steps nothing, without error;
// a step whose backward reached only some units (a block whose output is unused) steps.
TEST(StepWithoutGradient, TorchOptimizerFrozenModelAndAPartialBackward) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    {
      std::shared_ptr<FSDPModule> root;
      Net net = shard(mesh, root, ShardingStrategy::kFullShard);
      auto optim = TorchOptimizer::make<torch::optim::Adam>(root, torch::optim::AdamOptions(1e-2));
      const at::Tensor start = masters(*root);
      step_error(*optim);
      EXPECT_TRUE(at::equal(masters(*root), start));
    }
    {
      Net net = make_net();
      for (auto& p : net->parameters()) p.requires_grad_(false);
      for (auto& b : net->blocks) fully_shard(b, mesh);
      auto root = fully_shard(net, mesh);
      AdamW optim(root, AdamWOptions(1e-2));
      EXPECT_NO_THROW(optim.step());
    }
    {
      NetOptions o;
      o.skip_block = 1;
      Net net = [&] {
        std::lock_guard<std::mutex> lock(g_seed_mutex);
        at::manual_seed(23);
        return Net(o);
      }();
      for (auto& b : net->blocks) fully_shard(b, mesh);
      auto root = fully_shard(net, mesh);
      AdamW optim(root, AdamWOptions(1e-2));
      const at::Tensor start = masters(*root);
      auto [x, y] = batch(dist, 0);
      at::mse_loss(fsdp::call(net, x), y).backward();
      EXPECT_NO_THROW(optim.step());
      EXPECT_FALSE(at::equal(masters(*root), start));
    }
  });
}

// ---- a sharded module registered at two paths

class TwiceImpl : public torch::nn::Module {
 public:
  TwiceImpl() : block(register_module("first", Dense(6, 6))) { register_module("again", block); }
  at::Tensor forward(const at::Tensor& x) { return fsdp::call(block, at::tanh(fsdp::call(block, x))); }
  Dense block;
};
TORCH_MODULE(Twice);

// One module instance registered at two paths and sharded is refused at the root's first use,
// naming both paths.
TEST(ErrorPaths, ModuleRegisteredAtTwoPathsNamesBoth) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Twice net;
    fully_shard(net->block, mesh);
    auto root = fully_shard(net, mesh);
    const std::string what = config_error_of([&] { fsdp::call(net, at::ones({2, 6})); });
    EXPECT_NE(what.find("sharded module 'first' is registered at two paths, also as 'again'"), std::string::npos)
        << what;
    EXPECT_NE(what.find("register it at one path"), std::string::npos) << what;
  });
}

// A model built on the meta device without an init is refused at fully_shard, naming a parameter
// and both remedies; with init::from_load() it waits for a load, and a forward before any load is a
// UsageError naming the parameter.
TEST(ErrorPaths, MetaModelWithoutInitRefusedAtFullyShard) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    NetOptions o;
    o.device = at::kMeta;
    Net net(o);
    std::string what;
    try {
      fully_shard(net->blocks[0], mesh);
      ADD_FAILURE() << "a meta block without an init was sharded";
    } catch (const ConfigError& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("is on the meta device but FullyShardOptions::init is not set"), std::string::npos) << what;
    EXPECT_NE(what.find("fsdp::init::from_load()"), std::string::npos) << what;
    EXPECT_NE(what.find("'fc1.weight'"), std::string::npos) << what;

    Net loaded(o);
    const auto opts = FullyShardOptions().init(init::from_load());
    for (auto& block : loaded->blocks) fully_shard(block, mesh, opts);
    fully_shard(loaded, mesh, opts);
    const std::string used = testing::usage_error_of([&] { fsdp::call(loaded, at::ones({2, o.in})); });
    EXPECT_NE(used.find("was left to a load"), std::string::npos) << used;
    EXPECT_NE(used.find("before a load wrote it"), std::string::npos) << used;
  });
}

}  // namespace
}  // namespace fsdp
