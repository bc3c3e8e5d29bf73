// A user's model of stock LibTorch modules (Embedding, Conv1d, BatchNorm1d, LayerNorm, Linear)
// built on the meta device with fsdp::MetaDeviceGuard, planned with model_shape without
// allocating it, then materialised shard by shard: 2 ranks equal the unsharded model built and
// initialised the same way; and, in the processes tier, a model whose unsharded fp32 size is
// several times the peak RSS of each rank that builds, shards and trains it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <optional>

#include "fsdp/fsdp.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

// A residual block of stock modules: the user's own module, unchanged.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  at::Tensor forward(const at::Tensor& h) { return h + down(at::gelu(up(norm(h)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct StockNetImpl : torch::nn::Module {
  StockNetImpl(int64_t vocab, int64_t d, int64_t n_blocks)
      : embed(register_module("embed", torch::nn::Embedding(vocab, d))),
        conv(register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(d, d, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm1d(d))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        head(register_module("head", torch::nn::Linear(d, vocab))) {
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(Block(d));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = embed(tokens);  // [B, T, d]
    h = h + bn(conv(h.transpose(1, 2))).transpose(1, 2);
    for (size_t i = 0; i < blocks->size(); ++i) h = fsdp::call(blocks->ptr<BlockImpl>(i), h);
    return head(norm(h));
  }
  torch::nn::Embedding embed;
  torch::nn::Conv1d conv;
  torch::nn::BatchNorm1d bn;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(StockNet);

ParamInitFn stock_init() {
  return init::by_suffix({{"norm.weight", init::constant(1)},
                          {"bn.weight", init::constant(1)},
                          {"running_var", init::constant(1)},
                          {"running_mean", init::constant(0)},
                          {"bias", init::constant(0)}},
                         init::normal(0.02, 7));
}

StockNet build_on_meta(int64_t vocab, int64_t d, int64_t n_blocks) {
  MetaDeviceGuard meta;
  return StockNet(vocab, d, n_blocks);
}

// Every block a unit, then the root; the handles in that order (the root's last).
std::vector<std::shared_ptr<FSDPModule>> shard_stock(StockNet& net, DeviceMesh& mesh, const FullyShardOptions& opts) {
  std::vector<std::shared_ptr<FSDPModule>> units;
  for (size_t i = 0; i < net->blocks->size(); ++i)
    units.push_back(fully_shard(net->blocks->ptr<BlockImpl>(i), mesh, opts));
  units.push_back(fully_shard(net, mesh, opts));
  return units;
}

LoraOptions nf4_lora() { return LoraOptions().targets({"up", "down"}).r(8).alpha(16).base_dtype(FrozenStorage::kNF4); }

// A rank of run_processes: one intra-op thread (two ranks share two cores).
std::shared_ptr<Dist> process_rank() {
  at::set_num_threads(1);
  return init_from_env(InitOptions().timeout(std::chrono::seconds(120)));
}

bool is_block(const std::string& name, torch::nn::Module&) {
  return name.rfind("blocks.", 0) == 0 && name.find('.', 7) == std::string::npos;
}

at::Tensor batch_tokens(int64_t vocab, int64_t rows, int64_t seq) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  return at::randint(vocab, {rows, seq}, gen);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& tokens) {
  const int64_t v = logits.size(-1);
  return at::cross_entropy_loss(logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, v}),
                                tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1}));
}

TEST(MetaBuild, StockModulesBuildOnMetaAndPlanWithoutAllocating) {
  const c10::impl::LocalDispatchKeySet before = c10::impl::tls_local_dispatch_key_set();
  StockNet net = build_on_meta(50, 16, 3);
  for (const auto& p : net->named_parameters()) EXPECT_TRUE(p.value().is_meta()) << p.key();
  EXPECT_TRUE(net->bn->running_mean.is_meta());
  // Built from a value, the counter stays real (it already holds its value).
  EXPECT_FALSE(net->bn->num_batches_tracked.is_meta());
  EXPECT_EQ(at::zeros({2}).device().type(), at::kCPU) << "the guard ended with its scope";
  // The thread's dispatch state is restored exactly: CPU operators compute on the CPU again.
  const c10::impl::LocalDispatchKeySet after = c10::impl::tls_local_dispatch_key_set();
  EXPECT_EQ(after.included_, before.included_);
  EXPECT_EQ(after.excluded_, before.excluded_);
  const at::Tensor y = at::arange(4, at::kFloat) * 2 + 1;  // 1, 3, 5, 7
  ASSERT_FALSE(y.is_meta());
  EXPECT_EQ(y.sum().item<float>(), 16.0f);
  EXPECT_EQ(y[3].item<float>(), 7.0f);
  const ModelShape shape = model_shape(*net, is_block);
  ASSERT_EQ(shape.units.size(), 4u);  // the root's own parameters, then three blocks
  int64_t numel = 0;
  for (const auto& p : net->parameters()) numel += p.numel();
  EXPECT_EQ(shape.numel(), numel);
  EXPECT_EQ(shape.units[1].numel(), 16 * 2 + 2 * 16 * 64 + 64 + 16);
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.is_meta());
}

// Built on meta, sharded with deferred init: 2 ranks train exactly as the unsharded model built the
// same way and initialised by init::materialize (parameters and the meta buffers).
TEST(MetaBuild, StockModulesShardedOnMetaMatchTheUnshardedModel) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    StockNet ref = build_on_meta(50, 16, 3);
    init::materialize(*ref, stock_init());
    for (const auto& b : ref->named_buffers()) EXPECT_FALSE(b.value().is_meta()) << b.key();
    EXPECT_TRUE(at::equal(ref->bn->running_var, at::ones({16})));
    StockNet net = build_on_meta(50, 16, 3);
    const auto opts = FullyShardOptions().init(stock_init());
    const auto units = shard_stock(net, mesh, opts);
    auto root = units.back();
    net->eval();  // BatchNorm on its running statistics: the same on a rank's rows as on the whole batch
    ref->eval();
    auto optim = TorchOptimizer::make<torch::optim::SGD>(root, torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_optim(ref->parameters(), torch::optim::SGDOptions(0.5));
    const at::Tensor all = batch_tokens(50, 4, 9);
    const at::Tensor mine = all.narrow(0, 2 * dist->rank(), 2);
    for (int step = 0; step < 3; ++step) {
      at::Tensor loss = lm_loss(fsdp::call(net, mine), mine);
      loss.backward();
      optim->step();
      optim->zero_grad();
      // The reference on the whole batch: the mean of the two ranks' losses.
      std::vector<at::Tensor> ref_losses;
      for (int r = 0; r < 2; ++r)
        ref_losses.push_back(lm_loss(ref->forward(all.narrow(0, 2 * r, 2)), all.narrow(0, 2 * r, 2)));
      ref_optim.zero_grad();
      ((ref_losses[0] + ref_losses[1]) / 2).backward();
      ref_optim.step();
      EXPECT_NEAR(loss.item<double>(), ref_losses[dist->rank()].item<double>(), 1e-5) << "step " << step;
    }
    for (auto& unit : units) unit->unshard();
    auto ref_params = ref->named_parameters();
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(at::allclose(p.value().detach(), ref_params[p.key()].detach(), 1e-5, 1e-6)) << p.key();
    }
    for (auto& unit : units) unit->reshard();
  });
}

int64_t peak_rss_bytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// Each rank a process of its own (so its peak RSS is its own) builds a 0.62B-parameter model of
// stock modules on meta, adds NF4 LoRA adapters, shards it with deferred init and trains two steps.
// Unsharded in fp32 it is 2.3 GiB; each rank's peak, the process itself included, must be under
// half of that: building it whole (or one rank holding it) would exceed it.
TEST(MetaBuildProcesses, ModelSeveralTimesEachRanksPeakIsBuiltShardedAndTrains) {
  constexpr int64_t kVocab = 8000, kD = 1024, kBlocks = 72;
  int64_t numel = 0;
  {
    StockNet shape_only = build_on_meta(kVocab, kD, kBlocks);
    for (const auto& p : shape_only->parameters()) numel += p.numel();
  }
  const int64_t whole_fp32 = numel * 4;
  testing::ProcessOptions options;
  options.timeout = std::chrono::seconds(400);
  auto results = testing::run_processes(
      2,
      [&](int rank) {
        DeviceMesh mesh(process_rank());
        StockNet net = build_on_meta(kVocab, kD, kBlocks);
        auto adapted = lora(*net, nf4_lora());
        const auto opts =
            FullyShardOptions().frozen_storage(adapted.frozen_storage()).init(adapted.init(stock_init(), /*seed=*/0));
        AdamW optim(shard_stock(net, mesh, opts).back(), AdamWOptions(1e-3));
        const at::Tensor tokens = batch_tokens(kVocab, 2, 16).narrow(0, rank, 1);
        std::vector<double> losses;
        for (int step = 0; step < 2; ++step) {
          at::Tensor loss = lm_loss(fsdp::call(net, tokens), tokens);
          loss.backward();
          optim.step();
          optim.zero_grad();
          losses.push_back(loss.item<double>());
        }
        const int64_t peak = peak_rss_bytes();
        std::printf(
            "rank %d: %lld parameters, %.0f MiB unsharded in fp32; peak RSS %.0f MiB (%.2fx); losses %.4f %.4f\n", rank,
            static_cast<long long>(numel), whole_fp32 / 1048576.0, peak / 1048576.0,
            static_cast<double>(whole_fp32) / static_cast<double>(peak), losses[0], losses[1]);
        EXPECT_LT(2 * peak, whole_fp32) << "peak RSS " << peak << " bytes against the model's " << whole_fp32;
        EXPECT_TRUE(std::isfinite(losses[0]) && std::isfinite(losses[1]));
        EXPECT_LT(losses[1], losses[0]) << "the adapters train";
      },
      options);
  testing::expect_all_ok(results);
  for (const auto& r : results) std::printf("%s", r.output.c_str());
}

// The plan of a user's own model, its activations measured by measure_activations (no formula),
// against the peak RSS of each rank that trains it, for a full fine-tune and for NF4 LoRA. The
// activations are most of the step's memory here (a 512-token sequence, batch 8, an 8000-token
// vocabulary), so a plan without them would be far off (0.5x). Measured 1.05x for both (docs/NOTES.md,
// "Activations measured for any unit"); the bound is the goal, 0.9-1.1x.
void expect_plan_near_the_peak(bool lora_nf4) {
  constexpr int64_t kVocab = 8000, kD = 256, kBlocks = 4, kSeq = 512, kBatch = 8;
  testing::ProcessOptions options;
  options.timeout = std::chrono::seconds(400);
  auto results = testing::run_processes(
      2,
      [&](int rank) {
        // The process as a program that plans measures itself: before it joins the job (Note [The
        // process measured by the process]).
        const int64_t process = process_resident_bytes();
        DeviceMesh mesh(process_rank());
        StockNet net = build_on_meta(kVocab, kD, kBlocks);
        std::optional<LoraModel> adapted;
        if (lora_nf4) adapted = lora(*net, nf4_lora());
        ModelShape shape = model_shape(*net, is_block, adapted ? adapted->frozen_storage() : nullptr);
        // One real block and one real root (the model without blocks), their parameters trainable or
        // frozen as in the model, probed at small sizes.
        Block block(kD);
        StockNet root_layers(kVocab, kD, 0);
        if (lora_nf4) {
          lora(*block, nf4_lora());
          for (auto& p : root_layers->parameters()) p.set_requires_grad(false);
        }
        for (auto& unit : shape.units) {
          if (unit.is_root) {
            // The root's own layers as its forward runs them, the hidden state requiring grad as the
            // blocks' output does.
            measure_activations(unit, root_layers.ptr(), [&](int64_t b, int64_t s, at::ScalarType) {
              StockNetImpl& r = *root_layers;
              const at::Tensor tokens = at::randint(kVocab, {b, s});
              at::Tensor h = r.embed(tokens).detach().requires_grad_();
              h = h + r.bn(r.conv(h.transpose(1, 2))).transpose(1, 2);
              return lm_loss(r.head(r.norm(h)), tokens);
            });
          } else {
            measure_activations(unit, block.ptr(), [&](int64_t b, int64_t s, at::ScalarType) {
              return block->forward(at::randn({b, s, kD}).requires_grad_());
            });
          }
        }
        PlanRequest req;
        req.ranks_per_node = 2;
        req.seq_len = kSeq;
        req.batch_per_rank = kBatch;
        req.micro_batch = kBatch;
        req.strategy = ShardingStrategy::kFullShard;
        req.offload = OffloadPolicy();
        req.checkpoint_every = 0;
        req.budget = {int64_t{64} << 30, int64_t{64} << 30, 0};
        req.measured_process_bytes = process;
        const Plan p = plan(shape, req);
        ASSERT_TRUE(p.fits) << p.to_string();

        auto opts = FullyShardOptions().init(stock_init());
        if (adapted)
          opts = FullyShardOptions().frozen_storage(adapted->frozen_storage()).init(adapted->init(stock_init(), 0));
        AdamW optim(shard_stock(net, mesh, opts).back(), AdamWOptions(1e-3));
        auto gen = at::make_generator<at::CPUGeneratorImpl>(10 + rank);
        const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, gen);
        for (int step = 0; step < 2; ++step) {
          at::Tensor loss = lm_loss(fsdp::call(net, tokens), tokens);
          loss.backward();
          optim.step();
          optim.zero_grad();
        }
        const double measured = static_cast<double>(peak_rss_bytes()), planned = static_cast<double>(p.device.total());
        int64_t activations = 0;
        for (const auto& item : p.device.at_backward_start) {  // kept from forward, and the backward's transients
          const bool act = item.first.rfind("activations", 0) == 0 ||
                           item.first.find("transient") != std::string::npos ||
                           item.first.find("rebuilt") != std::string::npos;
          activations += act ? item.second : 0;
        }
        std::printf("rank %d (%s): planned %.0f MiB (activations %.0f MiB), measured peak RSS %.0f MiB: %.3fx\n%s\n",
                    rank, lora_nf4 ? "NF4 LoRA" : "full fine-tune", planned / 1048576.0, activations / 1048576.0,
                    measured / 1048576.0, measured / planned, p.to_string().c_str());
        EXPECT_GT(static_cast<double>(activations), 0.2 * planned) << "the activations must matter to this check";
        EXPECT_GE(measured / planned, 0.9);
        EXPECT_LE(measured / planned, 1.1);
      },
      options);
  testing::expect_all_ok(results);
  for (const auto& r : results) std::printf("%s", r.output.c_str());
}

TEST(MetaBuildProcesses, PlanOfAFullFineTuneWithMeasuredActivations) { expect_plan_near_the_peak(false); }
TEST(MetaBuildProcesses, PlanOfNf4LoraWithMeasuredActivations) { expect_plan_near_the_peak(true); }

}  // namespace
}  // namespace fsdp
