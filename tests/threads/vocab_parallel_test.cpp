// Vocab-parallel tables (fsdp/vocab_parallel.h): a frozen embedding tied to the head, never
// gathered, against the same model unsharded. Shapes whose shards end inside a row (split rows)
// and ranks with different token counts and ignored targets; the lookup exactly, the loss and the
// gradients within fp32 rounding; bf16 compute against the unsharded bf16 computation; and the
// misuses, each refused by name on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <mutex>

#include "fsdp/fsdp.h"
#include "support/ranks.h"
#include "support/usage_error.h"

namespace fsdp {
namespace {

std::mutex g_seed_mutex;

struct TableImpl : torch::nn::Module {
  TableImpl(int64_t vocab, int64_t dim) : weight(register_parameter("weight", at::randn({vocab, dim}), false)) {}
  at::Tensor forward(const at::Tensor& tokens) { return at::embedding(weight, tokens); }
  at::Tensor weight;
};
TORCH_MODULE(Table);

// Tokens -> the tied table's rows -> a trained projection -> the loss over the same table.
struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl(int64_t vocab, int64_t dim)
      : embed(register_module("embed", Table(vocab, dim))),
        proj(register_module("proj", torch::nn::Linear(dim, dim))) {}
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& targets) {
    const at::Tensor x = sharded_embedding(*embed, tokens);
    const at::Tensor h = at::tanh(proj(x.to(proj->weight.scalar_type())));
    return sharded_cross_entropy(*embed, h, targets, -100, /*chunk_rows=*/5);
  }
  Table embed;
  torch::nn::Linear proj;
};
TORCH_MODULE(TiedNet);

TiedNet make_net(int64_t vocab, int64_t dim) {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(3);
  return TiedNet(vocab, dim);
}

// Rank r's batch: 4 + 3r tokens (so the ranks differ), one target ignored.
std::pair<at::Tensor, at::Tensor> batch(int rank, int64_t vocab, int step) {
  at::Generator gen = at::detail::createCPUGenerator(100 * step + rank);
  const int64_t n = 4 + 3 * rank;
  at::Tensor tokens = at::randint(vocab, {1, n}, gen);
  at::Tensor targets = at::randint(vocab, {1, n}, gen);
  targets[0][n / 2] = -100;
  tokens[0][0] = vocab - 1;  // the last row, which the last shard holds before its padding
  return {tokens, targets};
}

// Two SGD steps sharded over `world` ranks against the same steps unsharded on each rank's batch
// (gradients averaged over the ranks, as the reduce-scatter averages them).
void check_parity(int world, int64_t vocab, int64_t dim) {
  testing::run_threads(world, [=](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TiedNet ref = make_net(vocab, dim), net = make_net(vocab, dim);
    fully_shard(net->embed, mesh, FullyShardOptions().vocab_parallel(true));
    auto root = fully_shard(net, mesh);
    torch::optim::SGD ref_opt(ref->proj->parameters(), torch::optim::SGDOptions(0.5));
    auto opt = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.5));
    for (int step = 0; step < 2; ++step) {
      ref_opt.zero_grad();
      at::Tensor ref_mine;
      for (int r = 0; r < world; ++r) {
        auto [tokens, targets] = batch(r, vocab, step);
        at::Tensor l = ref->forward(tokens, targets);
        (l / world).backward();
        if (r == dist->rank()) ref_mine = l.detach();
      }
      ref_opt.step();
      auto [tokens, targets] = batch(dist->rank(), vocab, step);
      at::Tensor loss = fsdp::call(net, tokens, targets);
      EXPECT_NEAR(loss.item<double>(), ref_mine.item<double>(), 2e-6) << "rank " << dist->rank() << " step " << step;
      loss.backward();
      opt->step();
      opt->zero_grad();
    }
    // The projection after two steps: the gradients agreed.
    root->unshard();
    EXPECT_TRUE(at::allclose(net->proj->weight.detach(), ref->proj->weight.detach(), 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(net->proj->bias.detach(), ref->proj->bias.detach(), 1e-5, 1e-6));
    root->reshard();
  });
}

TEST(VocabParallel, TiedTableMatchesUnshardedOnTwoRanks) { check_parity(2, 37, 6); }
TEST(VocabParallel, RowsSplitBetweenShardsOnThreeRanks) { check_parity(3, 37, 6); }
TEST(VocabParallel, ShardsSmallerThanARowOnFourRanks) { check_parity(4, 3, 20); }
TEST(VocabParallel, OneRank) { check_parity(1, 11, 4); }

// The unsharded computation in bf16 compute, as mixed precision runs it: fp32 weights cast to bf16,
// the lookup, the projection and the logits (a bf16 product with the table) in bf16, the softmax
// and the loss in fp32. The gradients reach the fp32 weights through the casts.
at::Tensor bf16_loss(TiedNet& ref, const at::Tensor& tokens, const at::Tensor& targets) {
  const at::Tensor table = ref->embed->weight.to(at::kBFloat16);
  const at::Tensor x = at::embedding(table, tokens);
  const at::Tensor w = ref->proj->weight.to(at::kBFloat16), b = ref->proj->bias.to(at::kBFloat16);
  const at::Tensor z = at::linear(at::tanh(at::linear(x, w, b)), table).to(at::kFloat);
  return at::cross_entropy_loss(z.reshape({-1, z.size(-1)}), targets.reshape({-1}), {}, at::Reduction::Mean, -100);
}

// bf16 compute (fsdp-train's setting at 8B: param_dtype bf16, gradients reduced in fp32) against
// bf16_loss on each rank's batch, two SGD steps. Both sides round the same values to bf16; they
// differ where the sharded side sums a split row's logit from two ranks' fp32 partial products
// before rounding it, forms the hidden states' gradient in fp32 (Note [Vocab-parallel tables])
// where the reference runs a bf16 backward, and averages the gradient after the bf16 backward (the
// reference scales by 1/world before it). Measured: the losses within 8.4e-4 at the same weights
// and 1.9e-3 after a step, the projection after the steps (the sharded side's gathered bf16 copy
// against the reference's fp32 weights, that rounding included) within 1.02e-3; held to kLossTol
// and kWeightTol, about twice those.
void check_bf16(int world, int64_t vocab, int64_t dim) {
  constexpr double kLossTol = 4e-3, kWeightTol = 2e-3;
  testing::run_threads(world, [=](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TiedNet ref = make_net(vocab, dim), net = make_net(vocab, dim);
    auto opts = FullyShardOptions();
    opts.mp_policy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    fully_shard(net->embed, mesh, FullyShardOptions(opts).vocab_parallel(true));
    auto root = fully_shard(net, mesh, opts);
    torch::optim::SGD ref_opt(ref->proj->parameters(), torch::optim::SGDOptions(0.1));
    auto opt = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      ref_opt.zero_grad();
      at::Tensor ref_mine;
      for (int r = 0; r < world; ++r) {
        auto [tokens, targets] = batch(r, vocab, step);
        at::Tensor l = bf16_loss(ref, tokens, targets);
        (l / world).backward();
        if (r == dist->rank()) ref_mine = l.detach();
      }
      ref_opt.step();
      auto [tokens, targets] = batch(dist->rank(), vocab, step);
      at::Tensor loss = fsdp::call(net, tokens, targets);
      EXPECT_NEAR(loss.item<double>(), ref_mine.item<double>(), kLossTol)
          << "rank " << dist->rank() << " step " << step;
      loss.backward();
      opt->step();
      opt->zero_grad();
    }
    root->unshard();
    const double diff =
        (net->proj->weight.detach().to(at::kFloat) - ref->proj->weight.detach()).abs().max().item<double>();
    EXPECT_LE(diff, kWeightTol) << "rank " << dist->rank();
    root->reshard();
  });
}

TEST(VocabParallel, Bf16ComputeMatchesUnshardedBf16OnTwoRanks) { check_bf16(2, 37, 6); }
TEST(VocabParallel, Bf16ComputeRowsSplitOnThreeRanks) { check_bf16(3, 37, 6); }

// The lookup is exact: each rank's rows, whole or assembled from two shards' parts.
TEST(VocabParallel, LookupIsExact) {
  testing::run_threads(3, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TiedNet ref = make_net(37, 6), net = make_net(37, 6);
    fully_shard(net->embed, mesh, FullyShardOptions().vocab_parallel(true));
    fully_shard(net, mesh);
    auto [tokens, targets] = batch(dist->rank(), 37, 0);
    fsdp::call(net, tokens, targets);  // the root's lazy init
    const at::Tensor all = at::arange(37).view({1, 37});
    EXPECT_TRUE(at::equal(sharded_embedding(*net->embed, all), ref->embed->weight.unsqueeze(0)));
    EXPECT_TRUE(at::equal(sharded_embedding(*net->embed, tokens), at::embedding(ref->embed->weight, tokens)));
  });
}

// Never gathered: a step over a 1 MiB table (4,096 x 64 fp32) sends the ranks' ids, hidden states,
// targets and per-token sums, a few KiB, where one gather of the table would send half a MiB.
TEST(VocabParallel, AStepSendsTokensNotTheTable) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    TiedNet net = make_net(4096, 64);
    fully_shard(net->embed, mesh, FullyShardOptions().vocab_parallel(true));
    auto root = fully_shard(net, mesh);
    auto [tokens, targets] = batch(dist->rank(), 4096, 0);
    fsdp::call(net, tokens, targets).backward();  // the first step records the order, lazy init
    const CommStats before = mesh.shard_group().stats();
    fsdp::call(net, tokens, targets).backward();
    const CommStats d = mesh.shard_group().stats() - before;
    const uint64_t proj = 64 * 64 * 4 + 64 * 4;  // the root's own parameters: gathered and reduced
    EXPECT_LT(d.total_bytes_sent(), 2 * proj + (16u << 10)) << "rank " << dist->rank();
    EXPECT_GT(d.of(CollectiveKind::kAllGather).calls, 0u);
  });
}

// Misuse, refused by name: the table run through fsdp::call; a trainable table; a table inside an
// fsdp::Join; a target out of range on one rank, refused on every rank (the ids are checked after
// they are gathered).
TEST(VocabParallel, MisuseIsRefusedByName) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    {
      TiedNet net = make_net(37, 6);
      net->embed->weight.set_requires_grad(true);
      try {
        fully_shard(net->embed, mesh, FullyShardOptions().vocab_parallel(true));
        ADD_FAILURE() << "a trainable table was accepted";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("must be frozen"), std::string::npos) << e.what();
      }
    }
    TiedNet net = make_net(37, 6);
    fully_shard(net->embed, mesh, FullyShardOptions().vocab_parallel(true));
    auto root = fully_shard(net, mesh);
    auto [tokens, targets] = batch(dist->rank(), 37, 0);
    fsdp::call(net, tokens, targets);
    {
      Join join(*root);  // a finished rank would take no part in the table's collectives
      EXPECT_NE(testing::usage_error_of([&] { fsdp::call(net, tokens, targets); }).find("inside an fsdp::Join"),
                std::string::npos);
    }
    EXPECT_NE(testing::usage_error_of([&] { fsdp::call(net->embed, tokens); }).find("fsdp::sharded_embedding"),
              std::string::npos);
    if (dist->rank() == 1) targets[0][1] = 37;
    const std::string msg = testing::usage_error_of([&] { fsdp::call(net, tokens, targets); });
    EXPECT_NE(msg.find("rank 1 gave target id 37, outside the table's 37 rows"), std::string::npos) << msg;
  });
}

}  // namespace
}  // namespace fsdp
