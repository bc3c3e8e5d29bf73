// Uneven inputs under fsdp::Join (fsdp/join.h): generation of different lengths per rank, an eval
// set that does not divide evenly, and a unit one rank's batch skips in training, each against the
// unsharded model; ordinary training steps after a Join in which one rank ran no forward or
// skipped a unit, against the unsharded model; a finished rank while another trains is a
// UsageError on every rank; and the same divergence without a Join still fails at once, naming
// fsdp::Join.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <mutex>

#include "fsdp/fsdp.h"
#include "support/ranks.h"
#include "support/usage_error.h"

namespace fsdp {
namespace {

std::mutex g_seed_mutex;

struct ExpertImpl : torch::nn::Module {
  explicit ExpertImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 2 * d))),
        fc2(register_module("fc2", torch::nn::Linear(2 * d, d))) {}
  at::Tensor forward(const at::Tensor& h) { return fc2(at::tanh(fc1(h))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Expert);

// Tokens in, logits out; `experts` picks which expert blocks this forward reaches (a router's
// decision, made per rank by its batch).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : embed(register_module("embed", torch::nn::Embedding(20, 8))),
        experts(register_module("experts", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(8, 20))) {
    for (int i = 0; i < 3; ++i) experts->push_back(Expert(8));
  }
  at::Tensor forward(const at::Tensor& tokens, std::vector<int64_t> route) {
    at::Tensor h = embed(tokens);
    for (int64_t e : route) h = h + fsdp::call(experts->ptr<ExpertImpl>(e), h);
    return head(h);
  }
  torch::nn::Embedding embed;
  torch::nn::ModuleList experts;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

Net make_net() {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(9);
  return Net();
}

// The root's handle last, after the experts'.
std::vector<std::shared_ptr<FSDPModule>> shard_all(Net& net, DeviceMesh& mesh) {
  std::vector<std::shared_ptr<FSDPModule>> units;
  for (size_t i = 0; i < net->experts->size(); ++i)
    units.push_back(fully_shard(net->experts->ptr<ExpertImpl>(i), mesh));
  units.push_back(fully_shard(net, mesh));
  return units;
}

std::shared_ptr<FSDPModule> shard(Net& net, DeviceMesh& mesh) { return shard_all(net, mesh).back(); }

const std::vector<int64_t> kAll = {0, 1, 2};

// Greedy generation, the whole sequence each step: rank r generates 2 + 3r tokens.
TEST(Join, GenerationOfDifferentLengthsPerRank) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Net ref = make_net(), net = make_net();
    auto root = shard(net, mesh);
    c10::NoGradGuard no_grad;
    at::Tensor seq = at::tensor(std::vector<int64_t>{3 + dist->rank(), 7}).view({1, 2});
    at::Tensor ref_seq = seq.clone();
    Join join(*root);
    for (int step = 0; step < 2 + 3 * dist->rank(); ++step) {
      at::Tensor logits = fsdp::call(net, seq, kAll);
      at::Tensor ref_logits = ref->forward(ref_seq, kAll);
      EXPECT_TRUE(at::allclose(logits, ref_logits, 1e-6, 1e-7)) << "step " << step;
      seq = at::cat({seq, logits.select(1, -1).argmax(-1).view({1, 1})}, 1);
      ref_seq = at::cat({ref_seq, ref_logits.select(1, -1).argmax(-1).view({1, 1})}, 1);
    }
    join.finish();
    EXPECT_TRUE(at::equal(seq, ref_seq));
    EXPECT_EQ(seq.size(1), 2 + 2 + 3 * dist->rank());
    // After the Join every rank runs in step again, without agreement rounds.
    at::Tensor again = fsdp::call(net, seq.narrow(1, 0, 2), kAll);
    EXPECT_TRUE(at::allclose(again, ref->forward(seq.narrow(1, 0, 2), kAll), 1e-6, 1e-7));
  });
}

// 5 eval batches over 2 ranks: rank 0 takes 3, rank 1 takes 2; a batch's route differs by batch.
TEST(Join, EvalSetThatDoesNotDivideEvenly) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Net ref = make_net(), net = make_net();
    auto root = shard(net, mesh);
    net->eval();
    c10::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    const at::Tensor data = at::randint(20, {5, 2, 6}, gen);
    Join join(*root);
    int batches = 0;
    for (int64_t b = dist->rank(); b < 5; b += 2, ++batches) {
      const std::vector<int64_t> route = b % 2 == 0 ? kAll : std::vector<int64_t>{2};
      at::Tensor logits = fsdp::call(net, data[b], route);
      EXPECT_TRUE(at::allclose(logits, ref->forward(data[b], route), 1e-6, 1e-7)) << "batch " << b;
    }
    join.finish();
    EXPECT_EQ(batches, dist->rank() == 0 ? 3 : 2);
  });
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& tokens) {
  return at::cross_entropy_loss(logits.reshape({-1, 20}), tokens.reshape({-1}));
}

// Training: rank 1's batch never reaches expert 1 (nor expert 2 in odd steps). Inside a Join each
// step equals the unsharded model's step on the whole batch: the skipped units reduce zeros.
TEST(Join, TrainingStepsWhereOneRanksBatchSkipsAUnit) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Net ref = make_net(), net = make_net();
    const auto units = shard_all(net, mesh);
    auto root = units.back();
    auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.5));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
    const at::Tensor data = at::randint(20, {2, 3, 5}, gen);
    auto route_of = [](int rank, int step) {
      return rank == 0 ? kAll : (step % 2 == 0 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{0});
    };
    Join join(*root);
    for (int step = 0; step < 3; ++step) {
      at::Tensor loss = lm_loss(fsdp::call(net, data[dist->rank()], route_of(dist->rank(), step)), data[dist->rank()]);
      loss.backward();
      optim->step();
      optim->zero_grad();
      std::vector<at::Tensor> ref_losses;
      for (int r = 0; r < 2; ++r) ref_losses.push_back(lm_loss(ref->forward(data[r], route_of(r, step)), data[r]));
      ref_optim.zero_grad();
      ((ref_losses[0] + ref_losses[1]) / 2).backward();
      ref_optim.step();
      EXPECT_NEAR(loss.item<double>(), ref_losses[dist->rank()].item<double>(), 1e-5) << "step " << step;
    }
    join.finish();
    for (auto& unit : units) unit->unshard();
    auto ref_params = ref->named_parameters();
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(at::allclose(p.value().detach(), ref_params[p.key()].detach(), 1e-5, 1e-6)) << p.key();
    }
    for (auto& unit : units) unit->reshard();
  });
}

// One training step on both ranks (rank r's batch: data[r], along route(r)) and the unsharded
// model's step on the whole batch: the losses agree.
void train_step(Net& net, Net& ref, TorchOptimizer& optim, torch::optim::SGD& ref_optim, const at::Tensor& data,
                int rank, const std::function<std::vector<int64_t>(int)>& route) {
  at::Tensor loss = lm_loss(fsdp::call(net, data[rank], route(rank)), data[rank]);
  loss.backward();
  optim.step();
  optim.zero_grad();
  std::vector<at::Tensor> ref_losses;
  for (int r = 0; r < 2; ++r) ref_losses.push_back(lm_loss(ref->forward(data[r], route(r)), data[r]));
  ref_optim.zero_grad();
  ((ref_losses[0] + ref_losses[1]) / 2).backward();
  ref_optim.step();
  EXPECT_NEAR(loss.item<double>(), ref_losses[rank].item<double>(), 1e-5);
}

void expect_params_equal(Net& net, Net& ref, const std::vector<std::shared_ptr<FSDPModule>>& units) {
  for (auto& unit : units) unit->unshard();
  auto ref_params = ref->named_parameters();
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(at::allclose(p.value().detach(), ref_params[p.key()].detach(), 1e-5, 1e-6)) << p.key();
  }
  for (auto& unit : units) unit->reshard();
}

std::vector<int64_t> all_units(int) { return kAll; }

// After a Join in which the ranks ran different forwards, ordinary training steps run in step again:
// which unit keeps its params for backward and what to prefetch each rank decides from its
// recorded execution order, which leaves out the Join's forwards. Here an eval set smaller than
// the world comes first: rank 1 runs no forward at all inside the Join, rank 0 one; every rank
// then trains, as the unsharded model does.
TEST(Join, TrainingAfterAJoinWhereOneRankRanNoForward) {
  testing::run_threads(
      2,
      [](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        Net ref = make_net(), net = make_net();
        const auto units = shard_all(net, mesh);
        auto optim = TorchOptimizer::make<torch::optim::SGD>(units.back(), torch::optim::SGDOptions(0.5));
        torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.5));
        auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
        const at::Tensor eval = at::randint(20, {1, 2, 6}, gen), data = at::randint(20, {3, 2, 3, 5}, gen);
        {
          c10::NoGradGuard no_grad;
          Join join(*units.back());
          for (int64_t b = dist->rank(); b < eval.size(0); b += 2) {
            EXPECT_TRUE(at::allclose(fsdp::call(net, eval[b], kAll), ref->forward(eval[b], kAll), 1e-6, 1e-7));
          }
          join.finish();
        }
        for (int step = 0; step < 3; ++step)
          train_step(net, ref, *optim, ref_optim, data[step], dist->rank(), all_units);
        expect_params_equal(net, ref, units);
      },
      std::chrono::seconds(60));
}

// The same after a Join whose training step's forward skipped a unit on rank 1 (a layer drop, an
// expert no token reached), with ordinary steps before and after it.
TEST(Join, TrainingAfterAJoinWhereOneRanksForwardSkippedAUnit) {
  testing::run_threads(
      2,
      [](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        Net ref = make_net(), net = make_net();
        const auto units = shard_all(net, mesh);
        auto optim = TorchOptimizer::make<torch::optim::SGD>(units.back(), torch::optim::SGDOptions(0.5));
        torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.5));
        auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
        const at::Tensor data = at::randint(20, {4, 2, 3, 5}, gen);
        const int rank = dist->rank();
        train_step(net, ref, *optim, ref_optim, data[0], rank, all_units);
        {
          Join join(*units.back());
          train_step(net, ref, *optim, ref_optim, data[1], rank, [](int r) {
            return r == 0 ? kAll : std::vector<int64_t>{0, 2};
          });
          join.finish();
        }
        for (int step = 2; step < 4; ++step) train_step(net, ref, *optim, ref_optim, data[step], rank, all_units);
        expect_params_equal(net, ref, units);
      },
      std::chrono::seconds(60));
}

struct NormedImpl : torch::nn::Module {
  NormedImpl()
      : fc(register_module("fc", torch::nn::Linear(4, 4))), bn(register_module("bn", torch::nn::BatchNorm1d(4))) {}
  at::Tensor forward(const at::Tensor& x) { return bn(fc(x)); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(Normed);

// A training-mode forward inside a Join on rank 0 only changes its BatchNorm statistics: finish()
// synchronises them on every rank (rank 1 ran no forward), and the ranks stay in step.
TEST(Join, BuffersChangedOnOneRankAreSynchronisedAtFinish) {
  testing::run_threads(
      2,
      [](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        Normed net;
        auto root = fully_shard(net, mesh);
        {
          c10::NoGradGuard no_grad;
          Join join(*root);
          if (dist->rank() == 0) fsdp::call(net, at::randn({6, 4}) + 3);
          join.finish();
        }
        at::Tensor mean = net->bn->running_mean.detach().clone();
        at::Tensor both = at::empty({2, 4});
        dist->world().all_gather(both, mean, "test").wait();
        EXPECT_TRUE(at::equal(both[0], both[1])) << both;
        EXPECT_GT(mean.abs().sum().item<double>(), 0);  // rank 0's statistics, not the initial zeros
      },
      std::chrono::seconds(60));
}

// A rank that finished while the other runs a backward: a UsageError on both, naming the fix.
TEST(Join, FinishedRankWhileAnotherTrainsIsAUsageErrorOnEveryRank) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Net net = make_net();
    auto root = shard(net, mesh);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
    const at::Tensor tokens = at::randint(20, {2, 4}, gen);
    Join join(*root);
    const std::string msg = testing::usage_error_of([&] {
      if (dist->rank() == 1) {
        join.finish();
      } else {
        lm_loss(fsdp::call(net, tokens, kAll), tokens).backward();
      }
    });
    EXPECT_NE(msg.find("same number of training steps"), std::string::npos) << msg;
  });
}

// Without a Join, a unit one rank skips is a divergence: every rank fails at once, as before.
TEST(Join, WithoutAJoinASkippedUnitStillFailsAtOnce) {
  testing::run_threads(
      2,
      [](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        Net net = make_net();
        auto root = shard(net, mesh);
        c10::NoGradGuard no_grad;
        const at::Tensor tokens = at::zeros({1, 3}, at::kLong);
        try {
          const std::vector<int64_t> route = dist->rank() == 0 ? kAll : std::vector<int64_t>{0, 2};
          fsdp::call(net, tokens, route);
          ADD_FAILURE() << "no error";
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("experts.1"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("inside an fsdp::Join"), std::string::npos) << e.what();
        }
      },
      std::chrono::seconds(30));
}

}  // namespace
}  // namespace fsdp
