// A stock torch::nn::Sequential MLP with BatchNorm, trained sharded: one unit per Linear (each
// wrapped in fsdp::Sharded), the BatchNorm layers in the root's unit, a torch::optim::Adam over the
// shards, a checkpoint at the end and --resume from it. README.md shows the lines that differ
// from the unsharded program.
//
//   fsdp-run --nproc-per-node 2 -- fsdp-example-sequential --steps 6 --out /tmp/seq
//   fsdp-run --nproc-per-node 2 -- fsdp-example-sequential --steps 12 --out /tmp/seq --resume
//
// The global batch is 16 rows in micro-batches of 4 (BatchNorm normalises over a micro-batch):
// each rank runs 4 / WORLD_SIZE of them per step, so 1, 2 and 4 ranks print the same training
// losses. Not the same eval loss: BatchNorm's running statistics are buffers, which each rank
// updates from its own micro-batches only (rank 0's are printed), so they depend on the world size.
#include <ATen/ATen.h>
#include <fsdp/fsdp.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

struct Args {
  int64_t steps = 6;
  std::string out = "sequential-out";
  bool resume = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--resume") {
      a.resume = true;
    } else if (flag == "--steps" && i + 1 < argc) {
      a.steps = std::atoll(argv[++i]);
    } else if (flag == "--out" && i + 1 < argc) {
      a.out = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--out DIR] [--resume]\n", argv[0]);
      std::exit(2);
    }
  }
  return a;
}

constexpr int64_t kGlobalBatch = 16, kMicroBatch = 4, kIn = 16, kOut = 4;

// Step `step`'s global batch: the same on every rank and at every world size.
std::pair<at::Tensor, at::Tensor> global_batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = at::randn({kGlobalBatch, kIn}, gen);
  return {x, at::sin(2 * x.narrow(1, 0, kOut))};
}

}  // namespace

int train(const Args& args) {
  auto dist = fsdp::init_from_env();
  fsdp::DeviceMesh mesh(dist);
  at::manual_seed(0);
  torch::nn::Sequential net(fsdp::Sharded(torch::nn::Linear(kIn, 64)), torch::nn::BatchNorm1d(64), torch::nn::ReLU(),
                            fsdp::Sharded(torch::nn::Linear(64, 64)), torch::nn::BatchNorm1d(64), torch::nn::ReLU(),
                            fsdp::Sharded(torch::nn::Linear(64, kOut)));
  for (auto& block : fsdp::sharded_children(*net)) fsdp::fully_shard(block, mesh);
  auto root = fsdp::fully_shard(net, mesh);
  auto optim = fsdp::TorchOptimizer::make<torch::optim::Adam>(root, torch::optim::AdamOptions(1e-2));

  int64_t start = 0;
  if (args.resume && fsdp::checkpoint::has_latest(args.out)) {
    start = fsdp::checkpoint::load(fsdp::checkpoint::resolve(args.out, "latest"), *root, optim.get()).step;
  }
  const int64_t micro_per_rank = kGlobalBatch / kMicroBatch / dist->world_size();
  for (int64_t step = start; step < args.steps; ++step) {
    auto [x, y] = global_batch(step);
    double loss_sum = 0;
    for (int64_t m = 0; m < micro_per_rank; ++m) {
      root->set_requires_gradient_sync(m == micro_per_rank - 1);  // reduce once, after the last
      const int64_t row = (dist->rank() * micro_per_rank + m) * kMicroBatch;
      auto loss = at::mse_loss(fsdp::call(net, x.narrow(0, row, kMicroBatch)), y.narrow(0, row, kMicroBatch)) /
                  static_cast<double>(micro_per_rank);
      loss.backward();
      loss_sum += loss.item<double>();
    }
    optim->step();
    optim->zero_grad();
    auto global = at::full({1}, loss_sum, at::kDouble);
    dist->world().all_reduce(global, fsdp::ReduceOp::kAvg, "loss").wait();
    if (dist->rank() == 0)
      std::printf("step %lld loss %.8f\n", static_cast<long long>(step + 1), global.item<double>());
  }
  fsdp::checkpoint::TrainState state;
  state.step = std::max(start, args.steps);
  fsdp::checkpoint::save(args.out, "step-" + std::to_string(state.step), *root, optim.get(), state);

  // Eval mode reads the running statistics: this rank's own (buffers are broadcast once, at
  // fully_shard, and then each rank updates its copy from its own micro-batches).
  net->eval();
  at::NoGradGuard no_grad;
  auto [x, y] = global_batch(-1);
  auto eval = at::mse_loss(fsdp::call(net, x), y).item<double>();
  if (dist->rank() == 0) std::printf("eval loss %.8f\n", eval);
  return 0;
}

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    return train(args);
  } catch (const std::exception& e) {  // fsdp's errors name what is wrong and what to do
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    fsdp::write_launcher_error(e);  // under torchrun, its summary shows the error
    return 1;
  }
}
