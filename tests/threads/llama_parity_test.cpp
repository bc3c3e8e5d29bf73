// Parity of a sharded Llama stack (tied embeddings, grouped-query attention, deferred init, each
// model family) with
// the same model trained unsharded: losses every step and every rank's shard at the end.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "llama.h"
#include "shard/testing.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

llama::LlamaConfig tiny_config(bool tied, const std::string& family = "llama") {
  llama::LlamaConfig c;
  c.model_type = family == "llama3" ? "llama" : family;
  if (family == "llama3") c.rope_scaling = {"llama3", 4.0, 1.0, 4.0, 8};
  if (family == "qwen3") c.head_dim_override = 8;
  if (family == "mistral") c.sliding_window = 4;
  c.vocab_size = 61, c.hidden_size = 24, c.intermediate_size = 37, c.num_hidden_layers = 3;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 32;
  c.tie_word_embeddings = tied;
  return c;
}

// loss_chunk > 0: the sharded model's loss is chunked (LlamaForCausalLM::forward(tokens, targets),
// fsdp::chunked_cross_entropy); the reference's stays the whole-logits llama::loss.
// split: the embedding and the head sharded as units of their own (llama::shard_embedding_and_head).
// vocab: the embedding and the head frozen in both models, and vocab-parallel tables in the sharded
// one (llama::shard_vocab_parallel).
void llama_parity(int world, bool tied, ShardingStrategy strategy, const std::string& family = "llama",
                  int64_t loss_chunk = 0, bool split = false, bool vocab = false) {
  const auto cfg = tiny_config(tied, family);
  constexpr int64_t kBatch = 12, kSeq = 9;  // global batch: 12 sequences, divisible by 1-4
  testing::run_threads(world, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto init = llama::llama_init_fn(cfg, 99);
    // Reference: a full model built on meta and materialised with the same initialiser.
    llama::LlamaForCausalLM ref(cfg, at::kMeta);
    init::materialize(*ref, init);
    llama::LlamaForCausalLM model(cfg, at::kMeta);  // never allocated whole
    model->set_loss_chunk_tokens(loss_chunk);
    for (auto* m : {&ref, &model}) {
      if (!vocab) break;
      (*m)->model->embed_tokens->weight.set_requires_grad(false);
      (*m)->lm_head->weight.set_requires_grad(false);
    }
    auto opts = FullyShardOptions().strategy(strategy).init(init);
    for (auto& layer : model->model->layers) fully_shard(layer, mesh, opts);
    if (split) llama::shard_embedding_and_head(model, mesh, opts);
    if (vocab) llama::shard_vocab_parallel(model, mesh, opts);
    auto root = fully_shard(model, mesh, opts);
    if (split) ASSERT_EQ(fsdp::testing::units(*root).size(), cfg.num_hidden_layers + 3u);
    AdamW optim(root, AdamWOptions(3e-3).weight_decay(0.1));

    auto ref_params = llama::unique_parameters(*ref);
    std::map<const void*, std::pair<at::Tensor, at::Tensor>> st;
    const int64_t local = kBatch / world;
    for (int step = 0; step < 10; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
      auto tokens = at::randint(cfg.vocab_size, {kBatch, kSeq + 1}, gen);
      auto in = tokens.narrow(1, 0, kSeq), tgt = tokens.narrow(1, 1, kSeq);
      const at::Tensor my_in = in.narrow(0, dist->rank() * local, local),
                       my_tgt = tgt.narrow(0, dist->rank() * local, local);
      auto loss =
          loss_chunk > 0 || vocab ? fsdp::call(model, my_in, my_tgt) : llama::loss(fsdp::call(model, my_in), my_tgt);
      loss.backward();
      auto ref_loss = llama::loss(ref->forward(in), tgt);
      ref_loss.backward();
      auto l = at::full({1}, loss.item<double>(), at::kDouble);
      dist->world().all_reduce(l, ReduceOp::kAvg, "loss").wait();
      EXPECT_NEAR(l.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>())
          << "step " << step << " rank " << dist->rank();
      optim.step();
      optim.zero_grad();
      // Reference AdamW, no decay for 1-D params (norm weights), as the default grouping.
      c10::NoGradGuard ng;
      for (auto& p : ref_params) {
        if (!p.requires_grad()) continue;
        const double wd = p.dim() >= 2 ? 0.1 : 0.0, lr = 3e-3;
        auto& s = st[p.unsafeGetTensorImpl()];
        if (!s.first.defined()) s = {at::zeros_like(p), at::zeros_like(p)};
        p.mul_(1 - lr * wd);
        s.first.lerp_(p.grad(), 0.1);
        s.second.mul_(0.999).addcmul_(p.grad(), p.grad(), 0.001);
        const double bc1 = 1 - std::pow(0.9, step + 1.0), bc2 = 1 - std::pow(0.999, step + 1.0);
        p.addcdiv_(s.first, (s.second.sqrt() / std::sqrt(bc2)).add_(1e-8), -lr / bc1);
        p.mutable_grad() = at::Tensor();
      }
    }
    std::map<std::string, at::Tensor> named;
    for (auto& item : ref->named_parameters()) named[item.key()] = item.value();
    for (const auto& unit : fsdp::testing::units(*root)) {
      for (auto& fp : unit->flat_params()) {
        std::vector<at::Tensor> flat;
        for (const auto& e : fp->entries()) flat.push_back(named.at(unit->prefix() + e.name).detach().reshape({-1}));
        auto full = at::constant_pad_nd(at::cat(flat), {0, fp->padded_numel() - fp->numel()});
        const double err =
            (fp->sharded_param() - full.narrow(0, fp->shard_offset(), fp->shard_numel())).abs().max().item<double>();
        EXPECT_LE(err, 2e-5) << fp->config().tag << " rank " << dist->rank();
      }
    }
  });
}

TEST(ParityLlama, TiedFullShardWorld2) { llama_parity(2, true, ShardingStrategy::kFullShard); }
TEST(ParityLlama, UntiedFullShardWorld4) { llama_parity(4, false, ShardingStrategy::kFullShard); }
// Each family's own parameters and attention (qwen2's biases, qwen3's q/k norms, mistral's window,
// llama3 rope scaling) through sharding.
TEST(ParityLlama, EveryFamilyFullShardWorld2) {
  for (const char* family : {"llama3", "qwen2", "qwen3", "mistral"}) {
    llama_parity(2, false, ShardingStrategy::kFullShard, family);
  }
}
// Frozen tables never gathered (a LoRA base's): the lookup and the loss computed on each rank's rows.
TEST(ParityLlama, VocabParallelTablesTiedWorld3AndUntiedWorld2) {
  llama_parity(3, true, ShardingStrategy::kFullShard, "llama", 0, false, true);
  llama_parity(2, false, ShardingStrategy::kFullShard, "qwen2", 0, false, true);
}
TEST(ParityLlama, TiedShardGradOpWorld3) { llama_parity(3, true, ShardingStrategy::kShardGradOp); }
// The chunked loss through the sharded root: chunks of 5 rows over each rank's 6 x 9 tokens (the
// last chunk short), the tied head's gradient joining the embedding's, and an untied head.
TEST(ParityLlama, ChunkedLossTiedAndUntiedWorld2) {
  llama_parity(2, true, ShardingStrategy::kFullShard, "llama", 5);
  llama_parity(2, false, ShardingStrategy::kFullShard, "qwen2", 16);
}

// The embedding and the head as units of their own, out of the root: the same training, with the
// whole logits and with the chunked loss run inside the head's unit.
TEST(ParityLlama, EmbeddingAndHeadAsUnitsWorld2) {
  llama_parity(2, false, ShardingStrategy::kFullShard, "llama", 0, true);
  llama_parity(2, false, ShardingStrategy::kFullShard, "qwen2", 16, true);
}

// A frozen embedding of its own (a LoRA base's) runs no backward: it is gathered once per step,
// in forward, and the backward's prefetch passes it by; the head, the last unit, keeps its params
// from forward to backward. All-gathers per step, one per flat param of a unit each time it is
// gathered: the root, the embedding and the head once, each layer twice (the head runs last). The
// tied config is refused, naming the tie.
TEST(ParityLlama, AFrozenEmbeddingOfItsOwnIsGatheredInForwardOnly) {
  const auto cfg = tiny_config(false);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    llama::LlamaForCausalLM model(cfg, at::kMeta);
    model->model->embed_tokens->weight.set_requires_grad(false);
    auto opts = FullyShardOptions().init(llama::llama_init_fn(cfg, 5));
    for (auto& layer : model->model->layers) fully_shard(layer, mesh, opts);
    llama::shard_embedding_and_head(model, mesh, opts);
    auto root = fully_shard(model, mesh, opts);
    const auto units = fsdp::testing::units(*root);
    ASSERT_EQ(units.size(), cfg.num_hidden_layers + 3u);
    uint64_t expected = 0;
    for (const auto& unit : units) {
      const bool layer = unit->prefix().find("layers.") != std::string::npos;
      expected += (layer ? 2 : 1) * unit->flat_params().size();
    }
    auto tokens = at::randint(cfg.vocab_size, {2, 9}, at::make_generator<at::CPUGeneratorImpl>(7));
    for (int step = 0; step < 3; ++step) {  // the first records the order the prefetch follows
      const CommStats before = mesh.shard_group().stats();
      llama::loss(fsdp::call(model, tokens), tokens).backward();
      const CommStats d = mesh.shard_group().stats() - before;
      if (step > 0) EXPECT_EQ(d.of(CollectiveKind::kAllGather).calls, expected) << "step " << step;
    }
    llama::LlamaForCausalLM tied(tiny_config(true), at::kMeta);
    try {
      llama::shard_embedding_and_head(tied, mesh, opts);
      ADD_FAILURE() << "a tied head was split";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("tie_word_embeddings"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace fsdp
