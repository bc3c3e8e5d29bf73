// Small models for sharding tests, written the way a user writes a model: ordinary LibTorch
// modules whose forward calls sharded children through fsdp::call. Shapes are odd on purpose so
// flat buffers need padding at every world size.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "fsdp/checkpoint_activations.h"
#include "fsdp/fully_shard.h"

namespace fsdp::testing {

// A bias-carrying linear layer whose parameters can be created on the meta device.
class DenseImpl : public torch::nn::Module {
 public:
  DenseImpl(int64_t in, int64_t out, at::Device device = at::kCPU) {
    auto opts = at::TensorOptions().device(device);
    weight = register_parameter("weight", at::randn({out, in}, opts) * (1.0 / std::sqrt(double(in))));
    bias = register_parameter("bias", at::randn({out}, opts) * 0.1);
  }
  // Shares `tied_weight` (registered in another module too) and owns a new bias.
  DenseImpl(const at::Tensor& tied_weight, int64_t out) {
    weight = register_parameter("weight", tied_weight);
    bias = register_parameter("bias", at::randn({out}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  at::Tensor weight, bias;
};
TORCH_MODULE(Dense);

// Two dense layers with a tanh between them and a residual when shapes allow.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t dim, int64_t hidden, at::Device device = at::kCPU)
      : fc1(register_module("fc1", Dense(dim, hidden, device))),
        fc2(register_module("fc2", Dense(hidden, dim, device))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fsdp::call(fc2, at::tanh(fsdp::call(fc1, x))); }
  Dense fc1, fc2;
};
TORCH_MODULE(Block);

struct NetOptions {
  int64_t in = 7, dim = 15, hidden = 13, out = 5;
  int blocks = 3;
  bool reuse_block = false;     // run block 0 twice in one forward
  int skip_block = -1;          // run this block's forward without using its output
  int checkpoint_block = -1;    // recompute this block's activations in backward
  bool reverse_blocks = false;  // run the blocks in reverse order (changes the execution order)
  at::Device device = at::kCPU;
};

class NetImpl : public torch::nn::Module {
 public:
  explicit NetImpl(const NetOptions& o) : opts(o) {
    inp = register_module("inp", Dense(o.in, o.dim, o.device));
    for (int i = 0; i < o.blocks; ++i) {
      blocks.push_back(register_module("blocks_" + std::to_string(i), Block(o.dim, o.hidden, o.device)));
    }
    head = register_module("head", Dense(o.dim, o.out, o.device));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(inp->forward(x));
    for (size_t k = 0; k < blocks.size(); ++k) {
      const size_t i = opts.reverse_blocks ? blocks.size() - 1 - k : k;
      if (static_cast<int>(i) == opts.skip_block) {
        (void)fsdp::call(blocks[i], h);  // computed, never reaches the loss
        continue;
      }
      if (static_cast<int>(i) == opts.checkpoint_block) {
        h = fsdp::checkpoint_activations(
            [block = blocks[i]](const at::Tensor& t) mutable { return fsdp::call(block, t); }, h);
        continue;
      }
      h = fsdp::call(blocks[i], h);
      if (i == 0 && opts.reuse_block) h = fsdp::call(blocks[i], h);
    }
    return head->forward(h);
  }
  NetOptions opts;
  Dense inp{nullptr}, head{nullptr};
  std::vector<Block> blocks;
};
TORCH_MODULE(Net);

}  // namespace fsdp::testing

namespace fsdp::testing {

// A language-model-shaped net whose token embedding is also its output projection (one tensor
// registered in two modules), with blocks in between.
class TiedNetImpl : public torch::nn::Module {
 public:
  TiedNetImpl(int64_t vocab, int64_t dim, int blocks_count) {
    embed = register_module("embed", Dense(dim, vocab));  // weight [vocab, dim]
    for (int i = 0; i < blocks_count; ++i) {
      blocks.push_back(register_module("blocks_" + std::to_string(i), Block(dim, dim + 3)));
    }
    out = register_module("out", Dense(embed->weight, vocab));  // tied: one tensor, two modules
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = at::embedding(embed->weight, tokens);
    for (auto& b : blocks) h = fsdp::call(b, h);
    return at::linear(h, out->weight, out->bias);
  }
  Dense embed{nullptr}, out{nullptr};
  std::vector<Block> blocks;
};
TORCH_MODULE(TiedNet);

}  // namespace fsdp::testing
