// A custom model whose sharded blocks return a pair of tensors and whose root returns a struct:
// fsdp::call hooks every tensor in both (the struct through the fsdp::ForwardOutput customization
// point), so backward gathers each unit again. README.md shows the lines that differ from the
// unsharded program.
//
//   fsdp-run --nproc-per-node 2 -- fsdp-example-two-heads --steps 6
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

// What the model returns: a prediction and an auxiliary output, each with its own loss.
struct Heads {
  torch::Tensor main, aux;
};

// Tells fsdp::call where the tensors of a Heads are.
template <>
struct fsdp::ForwardOutput<Heads> {
  template <typename F>
  static void for_each_tensor(Heads& heads, F&& f) {
    f(heads.main);
    f(heads.aux);
  }
};

// A residual block returning its output and its residual branch.
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(int64_t dim)
      : fc1(register_module("fc1", torch::nn::Linear(dim, 2 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(2 * dim, dim))) {}
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto branch = fc2->forward(torch::tanh(fc1->forward(x)));
    return {x + branch, branch};
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

class TwoHeadsImpl : public torch::nn::Module {
 public:
  TwoHeadsImpl(int64_t in, int64_t dim, int64_t out, int blocks)
      : inp(register_module("inp", torch::nn::Linear(in, dim))),
        head(register_module("head", torch::nn::Linear(dim, out))),
        aux(register_module("aux", torch::nn::Linear(dim, 1))),
        layers(register_module("layers", torch::nn::ModuleList())) {
    for (int i = 0; i < blocks; ++i) layers->push_back(Block(dim));
  }
  Heads forward(const torch::Tensor& x) {
    auto h = inp->forward(x);
    auto branch_norm = torch::zeros({x.size(0), 1});
    for (size_t i = 0; i < layers->size(); ++i) {
      auto [out, branch] = fsdp::call(layers->ptr<BlockImpl>(i), h);  // unsharded: ...->forward(h)
      h = out;
      branch_norm = branch_norm + branch.pow(2).mean(1, /*keepdim=*/true);
    }
    return {head->forward(h), aux->forward(h) + branch_norm};
  }
  torch::nn::Linear inp, head, aux;
  torch::nn::ModuleList layers;
};
TORCH_MODULE(TwoHeads);

int main(int argc, char** argv) {
  int64_t steps = 6;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--steps" && i + 1 < argc) {
      steps = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--steps N]\n", argv[0]);
      return 2;
    }
  }
  auto dist = fsdp::init_from_env();
  fsdp::DeviceMesh mesh(dist);
  torch::manual_seed(0);
  TwoHeads model(12, 24, 3, 3);
  for (size_t i = 0; i < model->layers->size(); ++i) fsdp::fully_shard(model->layers->ptr(i), mesh);
  auto root = fsdp::fully_shard(model, mesh);
  auto optim = fsdp::TorchOptimizer::make<torch::optim::AdamW>(root, torch::optim::AdamWOptions(3e-3));

  constexpr int64_t kGlobalBatch = 16;
  const int64_t local = kGlobalBatch / dist->world_size();
  for (int64_t step = 0; step < steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + step);
    auto x = torch::randn({kGlobalBatch, 12}, gen);
    auto y = torch::cos(x.narrow(1, 0, 3)), z = x.pow(2).mean(1, /*keepdim=*/true);
    const int64_t row = dist->rank() * local;
    Heads out = fsdp::call(model, x.narrow(0, row, local));
    auto loss =
        torch::mse_loss(out.main, y.narrow(0, row, local)) + 0.1 * torch::mse_loss(out.aux, z.narrow(0, row, local));
    loss.backward();
    optim->step();
    optim->zero_grad();
    auto global = loss.detach().to(torch::kDouble).reshape({1});
    dist->world().all_reduce(global, fsdp::ReduceOp::kAvg, "loss").wait();
    if (dist->rank() == 0)
      std::printf("step %lld loss %.8f\n", static_cast<long long>(step + 1), global.item<double>());
  }
  return 0;
}
