// Any LibTorch module: sharded blocks inside stock containers (fsdp::Sharded in a Sequential, an
// AnyModule, a ModuleList driven by the model's own forward), every return type fsdp::call looks
// into, and misuse as a UsageError on every rank (a forgotten fsdp::call at the root or at a
// child, a Sequential calling raw sharded children) before any operator reads a freed parameter;
// plus the bad inputs of fully_shard (no parameters, sharded twice, a child after its parent).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include <mutex>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "support/ranks.h"
#include "support/usage_error.h"

// A user type returned by a forward: fsdp::call reaches its tensors through ForwardOutput.
struct TwoHeads {
  at::Tensor main, aux;
  int64_t count = 0;
};
template <>
struct fsdp::ForwardOutput<TwoHeads> {
  template <typename F>
  static void for_each_tensor(TwoHeads& out, F&& f) {
    f(out.main);
    f(out.aux);
  }
};

namespace fsdp {
namespace {

std::mutex g_seed_mutex;

torch::nn::Sequential make_seq(bool wrap) {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(5);
  torch::nn::Linear a(6, 10), b(10, 3);
  if (!wrap) return torch::nn::Sequential(a, torch::nn::Tanh(), b);
  return torch::nn::Sequential(Sharded(a), torch::nn::Tanh(), Sharded(b));
}

using testing::usage_error_of;

std::pair<at::Tensor, at::Tensor> batch(int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto x = at::randn({8, 6}, gen), y = at::randn({8, 3}, gen);
  const int64_t n = 8 / world;
  return {x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
}

// The same Sequential sharded one unit per Linear on 2 ranks and unsharded on the whole batch:
// equal losses and parameters, and the unsharded model's names.
TEST(Containers, ShardedSequentialMatchesUnsharded) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto ref = make_seq(false);
    auto net = make_seq(true);
    std::vector<std::string> ref_names, names;
    for (const auto& p : ref->named_parameters()) ref_names.push_back(p.key());
    for (const auto& p : net->named_parameters()) names.push_back(p.key());
    EXPECT_EQ(names, ref_names);  // "0.weight", not "0.module.weight"
    const auto blocks = sharded_children(*net);
    ASSERT_EQ(blocks.size(), 2u);
    for (auto& block : blocks) fully_shard(block, mesh);
    auto root = fully_shard(net, mesh);
    auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.1));
    auto [x, y] = batch(dist->rank(), 2);
    auto [gx, gy] = batch(0, 1);
    for (int step = 0; step < 3; ++step) {
      auto loss = at::mse_loss(fsdp::call(net, x), y);
      loss.backward();
      optim->step();
      optim->zero_grad();
      auto l = loss.detach().to(at::kDouble).reshape({1});
      dist->world().all_reduce(l, ReduceOp::kAvg, "loss").wait();
      auto ref_loss = at::mse_loss(ref->forward(gx), gy);
      ref_loss.backward();
      ref_optim.step();
      ref_optim.zero_grad();
      EXPECT_NEAR(l.item<double>(), ref_loss.item<double>(), 1e-5) << "step " << step;
    }
  });
}

// A CNN of Sequential blocks (Conv2d, BatchNorm2d, ReLU, MaxPool2d), each block taken by
// fsdp::Sharded as it is, and a Linear head.
torch::nn::Sequential make_cnn() {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(9);
  auto block = [](int64_t in, int64_t out) {
    return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)),
                                 torch::nn::BatchNorm2d(out), torch::nn::ReLU(),
                                 torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
  };
  auto b0 = block(3, 5), b1 = block(5, 6);
  torch::nn::Linear head(6 * 2 * 2, 4);
  return torch::nn::Sequential(Sharded(b0), Sharded(b1), torch::nn::Flatten(), head);
}

// Sharded over each Sequential block on 2 ranks trains as the unsharded model (the same model
// without fully_shard: a Sequential cannot hold a Sequential, and Sharded unsharded is a plain
// forward): the same losses, parameters and BatchNorm running statistics, under the block's own
// names ("0.0.weight", "0.1.running_mean"), in the module tree and in a checkpoint loaded into
// an unsharded model. BatchNorm normalises over the
// batch a rank sees, so here every rank trains on the whole batch, as the unsharded model does;
// the reduce-scatter averages the ranks' (equal) gradients.
TEST(Containers, ShardedSequentialCnnBlocksMatchUnsharded) {
  const std::string dir = testing::temp_path("cnn-ckpt");
  io::make_dirs(dir);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto ref = make_cnn();
    auto net = make_cnn();
    const std::vector<std::string> expect_names = {"0.0.weight", "0.0.bias",   "0.1.weight", "0.1.bias", "1.0.weight",
                                                   "1.0.bias",   "1.1.weight", "1.1.bias",   "3.weight", "3.bias"};
    EXPECT_EQ(net->named_parameters().keys(), expect_names);
    const std::vector<std::string> expect_buffers = {"0.1.running_mean", "0.1.running_var", "0.1.num_batches_tracked",
                                                     "1.1.running_mean", "1.1.running_var", "1.1.num_batches_tracked"};
    EXPECT_EQ(net->named_buffers().keys(), expect_buffers);
    for (auto& block : sharded_children(*net)) fully_shard(block, mesh);
    auto root = fully_shard(net, mesh);
    auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 4; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + step);
      auto x = at::randn({6, 3, 8, 8}, gen), y = at::randn({6, 4}, gen);
      auto loss = at::mse_loss(fsdp::call(net, x), y);
      loss.backward();
      optim->step();
      optim->zero_grad();
      auto ref_loss = at::mse_loss(ref->forward(x), y);
      ref_loss.backward();
      ref_optim.step();
      ref_optim.zero_grad();
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5) << "step " << step;
    }
    checkpoint::save(dir, "cnn", *root, nullptr, checkpoint::TrainState());
    auto loaded = make_cnn();  // the initial values until loaded
    checkpoint::load_unsharded(dir + "/cnn", *loaded);
    for (const auto& p : ref->named_parameters()) {
      const at::Tensor got = loaded->named_parameters()[p.key()];
      EXPECT_TRUE(at::allclose(got, p.value(), 1e-5, 1e-6)) << p.key();
    }
    for (const auto& b : ref->named_buffers()) {
      const at::Tensor got = loaded->named_buffers()[b.key()];
      EXPECT_TRUE(at::allclose(got, b.value(), 1e-5, 1e-6)) << b.key();
    }
  });
}

// A module deriving from ModuleList with its own forward (ModuleList itself has none): Sharded
// takes that forward.
class StackImpl : public torch::nn::ModuleListImpl {
 public:
  StackImpl() {
    push_back(torch::nn::Linear(6, 6));
    push_back(torch::nn::Linear(6, 6));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (size_t i = 0; i < size(); ++i) h = at::tanh(ptr<torch::nn::LinearImpl>(i)->forward(h));
    return h;
  }
};
TORCH_MODULE(Stack);

TEST(Containers, ShardedModuleListWithItsOwnForward) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Stack ref, inner;
    {
      c10::NoGradGuard ng;
      for (size_t i = 0; i < 2; ++i) {
        for (auto* s : {&ref, &inner}) {
          (*s)->ptr<torch::nn::LinearImpl>(i)->weight.copy_(at::linspace(-1, 1, 36).reshape({6, 6}) * (i + 1.0));
          (*s)->ptr<torch::nn::LinearImpl>(i)->bias.fill_(0.1);
        }
      }
    }
    torch::nn::Linear head(6, 2);
    {
      c10::NoGradGuard ng;
      head->weight.copy_(at::linspace(-0.5, 0.5, 12).reshape({2, 6}));
      head->bias.fill_(0.2);
    }
    torch::nn::Sequential net{Sharded(inner), head};
    torch::nn::Sequential ref_net(ref, head);  // the same head module
    EXPECT_TRUE(net->named_parameters().contains("0.1.weight"));
    for (auto& block : sharded_children(*net)) fully_shard(block, mesh);
    auto x = at::linspace(-2, 2, 12).reshape({2, 6});
    const at::Tensor expect = ref_net->forward(x).detach();
    auto root = fully_shard(net, mesh);
    auto out = fsdp::call(net, x);
    EXPECT_TRUE(at::allclose(out, expect, 1e-5, 1e-6));
    out.sum().backward();
  });
}

// wrap_children rebuilds a Sequential (names kept); AnyModule and ModuleList blocks run as units.
TEST(Containers, WrapChildrenAnyModuleAndModuleList) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto net = wrap_children<torch::nn::LinearImpl>(make_seq(false));
    EXPECT_EQ(sharded_children(*net).size(), 2u);
    EXPECT_TRUE(net->named_parameters().contains("2.bias"));
    for (auto& block : sharded_children(*net)) fully_shard(block, mesh);
    auto root = fully_shard(net, mesh);
    auto [x, y] = batch(dist->rank(), 2);
    at::mse_loss(fsdp::call(net, x), y).backward();

    // AnyModule holding a sharded block: its forward runs the unit.
    torch::nn::AnyModule any(Sharded(torch::nn::Linear(6, 3)));
    fully_shard(any.ptr(), mesh);
    auto out = any.forward(x);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{4, 3}));
    out.sum().backward();

    // ModuleList: the model's own loop calls each block through fsdp::call.
    torch::nn::ModuleList list(torch::nn::Linear(6, 6), torch::nn::Linear(6, 6));
    for (size_t i = 0; i < list->size(); ++i) fully_shard(list->ptr(i), mesh);
    auto h = x;
    for (size_t i = 0; i < list->size(); ++i) h = fsdp::call(list->ptr<torch::nn::LinearImpl>(i), h);
    h.sum().backward();
  });
}

// Forgotten fsdp::call at the root: every rank gets a UsageError naming the module, before any
// kernel reads the freed parameter; the next, correct step trains normally.
TEST(Misuse, ForgottenCallAtTheRootIsAUsageErrorOnEveryRank) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto net = make_seq(true);
    for (auto& block : sharded_children(*net)) fully_shard(block, mesh);
    auto root = fully_shard(net, mesh);
    auto [x, y] = batch(dist->rank(), 2);
    const std::string what = usage_error_of([&] { net->forward(x); });
    EXPECT_NE(what.find("fsdp::call"), std::string::npos) << "rank " << dist->rank() << ": " << what;
    EXPECT_NE(what.find("Linear"), std::string::npos) << what;
    auto loss = at::mse_loss(fsdp::call(net, x), y);
    loss.backward();
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
  });
}

// A custom module whose forward calls a sharded child's forward directly.
class ParentImpl : public torch::nn::Module {
 public:
  ParentImpl()
      : head(register_module("head", torch::nn::Linear(6, 6))),
        tail(register_module("tail", torch::nn::Linear(6, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return tail->forward(fsdp::call(head, x)); }  // tail: forgotten
  torch::nn::Linear head, tail;
};
TORCH_MODULE(Parent);

// head and tail each their own unit, then the root.
std::shared_ptr<FSDPModule> shard_parent(Parent& net, DeviceMesh& mesh) {
  fully_shard(net->head, mesh);
  fully_shard(net->tail, mesh);
  return fully_shard(net, mesh);
}

TEST(Misuse, ChildForwardCalledDirectlyNamesTheChild) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Parent net;
    auto root = shard_parent(net, mesh);
    auto [x, y] = batch(dist->rank(), 2);
    const std::string what = usage_error_of([&] { fsdp::call(net, x); });
    EXPECT_NE(what.find("'tail'"), std::string::npos) << "rank " << dist->rank() << ": " << what;
  });
}

// One rank in fp32: nothing is freed, so nothing is guarded, but the gradient of a child run past
// fsdp::call arrives without the unit's pre-backward: a UsageError, not a silently lost gradient.
TEST(Misuse, OneRankLostGradientIsAUsageError) {
  testing::run_threads(1, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Parent net;
    auto root = shard_parent(net, mesh);
    auto out = fsdp::call(net, at::ones({2, 6}));
    const std::string what = usage_error_of([&] { out.sum().backward(); });
    EXPECT_NE(what.find("'tail'"), std::string::npos) << what;
  });
}

// A stock Sequential holding raw (unwrapped) sharded children: refused before its forward runs.
TEST(Misuse, SequentialWithRawShardedChildren) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto net = make_seq(false);
    fully_shard(net->ptr(0), mesh);
    fully_shard(net->ptr(2), mesh);
    auto root = fully_shard(net, mesh);
    auto [x, y] = batch(dist->rank(), 2);
    const std::string refused = usage_error_of([&] { fsdp::call(net, x); });
    EXPECT_NE(refused.find("fsdp::Sharded"), std::string::npos) << refused;
    // Inside a model's own forward the guard catches it the same way.
    const std::string guarded = usage_error_of([&] { net->forward(x); });
    EXPECT_NE(guarded.find("Sequential"), std::string::npos) << guarded;
  });
}

// Returns every kind of output fsdp::call looks into; each tensor gets the backward hook, so the
// gradients equal the unsharded model's.
class MultiImpl : public torch::nn::Module {
 public:
  MultiImpl() : fc(register_module("fc", torch::nn::Linear(6, 4))) {}
  std::tuple<std::pair<at::Tensor, std::optional<at::Tensor>>, std::vector<std::array<at::Tensor, 1>>,
             std::map<std::string, at::Tensor>, TwoHeads, std::string, int>
  forward(const at::Tensor& x) {
    auto h = fc->forward(x);
    return {{h * 2, h * 3}, {{h.sin()}}, {{"k", h.cos()}}, TwoHeads{h * 4, h * 5, 1}, "s", 7};
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(Multi);

at::Tensor total(std::tuple<std::pair<at::Tensor, std::optional<at::Tensor>>, std::vector<std::array<at::Tensor, 1>>,
                            std::map<std::string, at::Tensor>, TwoHeads, std::string, int>& o) {
  auto& [p, v, m, s, str, i] = o;
  return p.first.sum() + p.second->pow(2).sum() + v[0][0].sum() + m.at("k").sum() + s.main.sum() + s.aux.pow(2).sum();
}

TEST(CallOutputs, EveryNestingGetsTheBackwardHook) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Multi ref, net;
    {
      c10::NoGradGuard ng;
      for (auto* m : {&ref, &net}) {
        (*m)->fc->weight.copy_(at::linspace(-1, 1, 24).reshape({4, 6}));
        (*m)->fc->bias.fill_(0.1);
      }
    }
    auto root = fully_shard(net, mesh);
    auto x = at::linspace(-2, 2, 12).reshape({2, 6});
    auto out = fsdp::call(net, x);
    total(out).backward();
    auto ref_out = ref->forward(x);
    total(ref_out).backward();
    // Every rank's reduced gradient is the mean of identical ones: the reference's.
    EXPECT_EQ(std::get<4>(out), "s");
    EXPECT_EQ(std::get<3>(out).count, 1);
    auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(1.0));
    optim->step();
    ref->fc->weight.detach().sub_(ref->fc->weight.grad());
    root->unshard();
    EXPECT_TRUE(at::allclose(net->fc->weight.detach(), ref->fc->weight.detach(), 1e-5, 1e-6));
    root->reshard();
  });
}

// Bad input to fully_shard: each a ConfigError naming the module.
TEST(BadInput, NoParametersShardedTwiceChildAfterParent) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    torch::nn::ReLU relu;
    try {
      fully_shard(relu, mesh);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("no parameters"), std::string::npos) << e.what();
    }
    torch::nn::Linear lin(3, 3);
    fully_shard(lin, mesh);
    EXPECT_THROW(fully_shard(lin, mesh), ConfigError);
    Parent net;
    fully_shard(net, mesh);
    try {
      fully_shard(net->head, mesh);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("bottom-up"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("weight"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace fsdp
