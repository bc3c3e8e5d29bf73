// The planner (fsdp/plan.h) as a library call: a model's shape from a meta-device module counts
// each parameter once (tied ones too) into the units a predicate names; the plan keeps a caller's
// choices and makes the others fastest first; the step's peak is the larger of its two moments; a
// model that fits nothing says what is short and by how many bytes; a malformed request is a
// ConfigError naming the field.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp/errors.h"
#include "fsdp/plan.h"
#include "llama.h"
#include "plan_support.h"
#include "shape.h"

namespace fsdp {
namespace {

bool is_layer(const std::string& name, torch::nn::Module&) {
  return name.rfind("model.layers.", 0) == 0 && name.find('.', 13) == std::string::npos;
}

TEST(Plan, ModelShapeOfAMetaModuleCountsEachParameterOnceInItsUnit) {
  for (bool tied : {false, true}) {
    const auto c = qwen_like(tied);
    llama::LlamaForCausalLM model(c, at::kMeta);
    model->model->layers[0]->parameters()[0].set_requires_grad(false);  // one frozen parameter
    const ModelShape shape = model_shape(*model, is_layer);
    ASSERT_EQ(shape.units.size(), 4u);  // the root's own parameters, then 3 layers
    EXPECT_TRUE(shape.units[0].is_root);
    const auto counts = llama::param_counts(c);
    EXPECT_EQ(shape.numel(), counts.total(c)) << "tied=" << tied;
    EXPECT_EQ(shape.units[0].numel(), counts.root);
    for (size_t i = 1; i < 4; ++i) EXPECT_EQ(shape.units[i].numel(), counts.per_layer) << shape.units[i].name;
    EXPECT_GT(shape.units[1].frozen_numel, 0);
    EXPECT_EQ(shape.units[2].frozen_numel, 0);
    EXPECT_EQ(shape.units[0].largest_param_numel, c.vocab_size * c.hidden_size);
    // The model's own shape (with its activations) has the same units and sizes.
    const ModelShape from_config = llama::plan_shape(c);
    EXPECT_EQ(from_config.numel(), shape.numel());
  }
}

// Large enough (30M parameters) that its states dwarf the disk tier's 16 MiB window.
llama::LlamaConfig mid() {
  llama::LlamaConfig c = qwen_like(true);
  c.vocab_size = 32000, c.hidden_size = 512, c.intermediate_size = 1536, c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  return c;
}

// A chunked loss (fsdp::chunked_cross_entropy) keeps one fp32 log-sum-exp per token instead of the
// [tokens, vocab] log-probabilities, and its backward holds one chunk's logits and their gradient;
// the head's fp32 gradient sum is counted only where the head trains in a narrower dtype.
TEST(Plan, AChunkedLossKeepsNoLogitsAndItsBackwardHoldsOneChunk) {
  const auto c = qwen_like(false);
  const int64_t b = 4, t = 64, n = b * t, v = c.vocab_size, h = c.hidden_size;
  const int64_t whole = llama::root_activation_bytes(c, b, t, at::kFloat);
  EXPECT_EQ(whole - llama::root_activation_bytes(c, b, t, at::kFloat, 32), 4 * n * v - 4 * n);
  EXPECT_EQ(llama::loss_backward_bytes(c, b, t, at::kFloat), 8 * n * v);
  // The larger of the forward's end (a chunk's logits and logsumexp's temporary) and the backward.
  EXPECT_EQ(llama::loss_backward_bytes(c, b, t, at::kFloat, 32), 8 * 32 * v);
  EXPECT_EQ(llama::loss_backward_bytes(c, b, t, at::kBFloat16, 32), std::max(6 * 32 * v + 4 * v * h, 10 * 32 * v));
  EXPECT_EQ(llama::loss_backward_bytes(c, b, t, at::kBFloat16, 32, /*head_trained=*/false), 10 * 32 * v);
  EXPECT_EQ(llama::loss_backward_bytes(c, b, t, at::kFloat, 100000), 8 * n * v) << "a chunk of more than the tokens";
  // Through the shape: the root's figures, and a plan that is smaller by the difference at least.
  const ModelShape chunked = llama::plan_shape(c, nullptr, 32), plain = llama::plan_shape(c);
  EXPECT_EQ(chunked.units[0].activations(b, t, at::kFloat, false),
            llama::root_activation_bytes(c, b, t, at::kFloat, 32));
  EXPECT_EQ(chunked.units[0].backward_peak(b, t, at::kFloat), 8 * 32 * v);
  PlanRequest req;
  req.seq_len = t;
  req.batch_per_rank = b;
  req.micro_batch = b;
  req.strategy = ShardingStrategy::kFullShard;
  req.offload = OffloadPolicy();
  req.checkpoint_every = 0;
  req.budget = {int64_t{64} << 30, int64_t{64} << 30, 0};
  EXPECT_LE(plan(chunked, req).device.total(), plan(plain, req).device.total() - (4 * n * v - 4 * n));
}

TEST(Plan, ChoosesNoOffloadWhenItFitsThenTheDiskTierAndKeepsFixedChoices) {
  const ModelShape shape = llama::plan_shape(mid());
  const Plan roomy = plan(shape, request(int64_t{8} << 30));
  ASSERT_TRUE(roomy.fits) << roomy.to_string();
  EXPECT_EQ(roomy.optimizer_state, OffloadTier::kNone);
  EXPECT_EQ(roomy.micro_batch, 4);
  EXPECT_EQ(roomy.grad_accum_steps, 1);
  EXPECT_EQ(roomy.shard_size, 2);
  // The total is the items alive throughout plus the larger of the two moments of backward.
  auto sum = [](const std::vector<std::pair<std::string, int64_t>>& v) {
    int64_t t = 0;
    for (const auto& [n, b] : v) t += b;
    return t;
  };
  const PlanTier& ram = roomy.device;
  EXPECT_EQ(ram.total(), sum(ram.items) + std::max(sum(ram.at_backward_start), sum(ram.at_backward_end)));
  EXPECT_FALSE(ram.at_backward_start.empty());
  EXPECT_FALSE(ram.at_backward_end.empty());
  EXPECT_GT(roomy.all_gather_bytes, 0);

  // Less RAM than the smallest in-memory plan (checkpointing, micro-batch 1) needs: the optimizer
  // state (and the master with it) goes to disk.
  PlanRequest smallest = request(int64_t{8} << 30);
  smallest.offload = OffloadPolicy();
  smallest.checkpoint_every = 1;
  smallest.micro_batch = 1;
  smallest.keep_gathered = false;
  const Plan tight = plan(shape, request(plan(shape, smallest).device.total() - (1 << 20)));
  ASSERT_TRUE(tight.fits) << tight.to_string();
  EXPECT_EQ(tight.optimizer_state, OffloadTier::kDisk);
  EXPECT_GT(tight.disk.total(), 0);
  EXPECT_GT(tight.io_per_step.disk_write, 0);

  // A caller's choices are kept (and only checked).
  PlanRequest fixed = request(int64_t{8} << 30);
  fixed.offload = OffloadPolicy().optimizer_state(OffloadTier::kDisk);
  fixed.checkpoint_every = 1;
  fixed.micro_batch = 2;
  const Plan kept = plan(shape, fixed);
  EXPECT_TRUE(kept.fits);
  EXPECT_EQ(kept.optimizer_state, OffloadTier::kDisk);
  EXPECT_EQ(kept.checkpoint_every, 1);
  EXPECT_EQ(kept.micro_batch, 2);
  EXPECT_EQ(kept.grad_accum_steps, 2);
}

// AdamW's moments in bf16: the state item is half the fp32 one, the rest unchanged; the disk tier
// (fp32 state only) is neither chosen nor accepted.
TEST(Plan, Bf16MomentsHalveTheStateAndStayOffTheDiskTier) {
  const ModelShape shape = llama::plan_shape(mid());
  const PlanRequest fp32 = request(int64_t{8} << 30);
  PlanRequest bf16 = fp32;
  bf16.optimizer_state_dtype = at::kBFloat16;
  const Plan a = plan(shape, fp32), b = plan(shape, bf16);
  ASSERT_TRUE(a.fits && b.fits);
  auto item = [](const PlanTier& t, const std::string& prefix) {
    for (const auto& [n, bytes] : t.items) {
      if (n.rfind(prefix, 0) == 0) return bytes;
    }
    return int64_t{-1};
  };
  // Two moments of 2 bytes instead of 4: 4 bytes less per trainable element of this rank's shard.
  const int64_t saved = item(a.device, "sharded states not offloaded") - item(b.device, "sharded states not offloaded");
  EXPECT_EQ(a.device.total() - b.device.total(), saved);
  const double per_rank = static_cast<double>(shape.trainable_numel()) / a.shard_size;
  EXPECT_NEAR(static_cast<double>(saved), 4 * per_rank, 0.01 * 4 * per_rank);
  // Tight enough that fp32 state would go to disk: bf16 state fits in RAM instead, or not at all.
  PlanRequest smallest = fp32;
  smallest.offload = OffloadPolicy();
  smallest.checkpoint_every = 1;
  smallest.micro_batch = 1;
  smallest.keep_gathered = false;
  PlanRequest tight = request(plan(shape, smallest).device.total() - (1 << 20));
  const Plan tight_fp32 = plan(shape, tight);
  ASSERT_EQ(tight_fp32.optimizer_state, OffloadTier::kDisk);
  tight.optimizer_state_dtype = at::kBFloat16;
  const Plan tight_bf16 = plan(shape, tight);
  EXPECT_TRUE(tight_bf16.fits) << tight_bf16.to_string();
  EXPECT_EQ(tight_bf16.optimizer_state, OffloadTier::kNone);
  // Nothing fits with fp32 state in RAM and no disk: the shortfall names the bf16 lever.
  PlanRequest no_disk = tight;
  no_disk.optimizer_state_dtype = at::kFloat;
  no_disk.budget.disk_bytes = 0;
  no_disk.offload = OffloadPolicy();
  no_disk.checkpoint_every = 1;
  no_disk.micro_batch = 1;
  no_disk.keep_gathered = false;
  const Plan short_fp32 = plan(shape, no_disk);
  ASSERT_FALSE(short_fp32.fits);
  EXPECT_NE(short_fp32.shortfall.find("PlanRequest::optimizer_state_dtype=bfloat16"), std::string::npos)
      << short_fp32.shortfall;
  tight.offload = OffloadPolicy().optimizer_state(OffloadTier::kDisk);
  try {
    plan(shape, tight);
    ADD_FAILURE() << "bf16 state in the disk tier was planned";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("disk tier"), std::string::npos) << e.what();
  }
}

// Units kept gathered across micro-batches: one all-gather per unit per step instead of one or two
// per micro-batch, every unit's gathered parameters held at once; chosen when it fits.
TEST(Plan, KeptGathersTradeTheGatheredModelForOneGatherPerUnitPerStep) {
  const ModelShape shape = llama::plan_shape(mid());
  PlanRequest r = request(int64_t{8} << 30);
  r.micro_batch = 1;  // 4 micro-batches
  r.keep_gathered = false;
  const Plan plain = plan(shape, r);
  r.keep_gathered = true;
  const Plan kept = plan(shape, r);
  ASSERT_TRUE(plain.fits && kept.fits);
  EXPECT_TRUE(kept.keep_gathered);
  EXPECT_EQ(kept.gathers_per_step, static_cast<int64_t>(shape.units.size()));
  // Every unit once per step against (2 per unit but the root and the last layer) x 4.
  int64_t once = 0, plain_bytes = 0;
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const auto& u = shape.units[i];
    const int64_t s = (u.numel() + 1) / 2 * 2;  // bf16 shard of 2 ranks
    once += s;
    plain_bytes += s * ((u.is_root || i + 1 == shape.units.size()) ? 1 : 2) * 4;
  }
  EXPECT_EQ(kept.all_gather_bytes, once);  // (N - 1) = 1 hop
  EXPECT_EQ(plain.all_gather_bytes, plain_bytes);
  auto item = [](const PlanTier& t, const std::string& prefix) {
    for (const auto& [n, bytes] : t.items) {
      if (n.rfind(prefix, 0) == 0) return bytes;
    }
    return int64_t{0};
  };
  EXPECT_EQ(item(kept.device, "gathered params (all, kept across micro-batches)"), 2 * shape.numel());
  EXPECT_EQ(item(kept.device, "gathered params (root"), 0);
  EXPECT_GT(kept.device.total(), plain.device.total());
  // Unset: chosen when it fits, not when only the plain plan does.
  r.keep_gathered.reset();
  EXPECT_TRUE(plan(shape, r).keep_gathered);
  PlanRequest tight = r;
  tight.budget.host_bytes = plain.device.total() + (kept.device.total() - plain.device.total()) / 2;
  tight.offload = OffloadPolicy();
  tight.checkpoint_every = 0;
  const Plan chosen = plan(shape, tight);
  EXPECT_TRUE(chosen.fits);
  EXPECT_FALSE(chosen.keep_gathered);
}

// Resharding to groups of 2 of 4 ranks: each layer's half held from forward to backward, whose
// gather runs in the group in the compute dtype; the forward's gather still crosses all 4.
TEST(Plan, ReshardToAGroupHoldsTheLayersPartsAndGathersThemInTheGroup) {
  const ModelShape shape = llama::plan_shape(mid());
  PlanRequest r = request(int64_t{8} << 30);
  r.ranks_per_node = 4;
  r.micro_batch = 4;  // one micro-batch
  r.strategy = ShardingStrategy::kFullShard;
  const Plan plain = plan(shape, r);
  r.reshard_after_forward_group = 2;
  const Plan grouped = plan(shape, r);
  ASSERT_TRUE(plain.fits && grouped.fits);
  int64_t parts = 0, in_group = 0, forward = 0, plain_bytes = 0;
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const auto& u = shape.units[i];
    const int64_t s = (u.numel() + 3) / 4 * 2;  // bf16 shard of 4 ranks
    plain_bytes += 3 * s * ((u.is_root || i + 1 == shape.units.size()) ? 1 : 2);
    forward += 3 * s;
    if (u.is_root) continue;
    const int64_t part = (u.numel() + 3) / 4 * 4 / 2 * 2;  // half the padded bf16 buffer
    parts += part;
    in_group += part;  // (2 - 1) parts sent
  }
  EXPECT_EQ(plain.all_gather_bytes, plain_bytes);
  EXPECT_EQ(plain.group_all_gather_bytes, 0);
  EXPECT_EQ(grouped.group_all_gather_bytes, in_group);
  EXPECT_EQ(grouped.all_gather_bytes, forward + in_group);
  int64_t held = 0;
  for (const auto& [n, bytes] : grouped.device.at_backward_start) {
    if (n.rfind("parts kept after forward", 0) == 0) held = bytes;
  }
  EXPECT_EQ(held, parts);
  EXPECT_NE(std::find(grouped.settings.begin(), grouped.settings.end(), "PlanRequest::reshard_after_forward_group=2"),
            grouped.settings.end());
  r.reshard_after_forward_group = 3;
  EXPECT_THROW(plan(shape, r), ConfigError);
}

// The embedding and the head as units of their own (llama::shard_embedding_and_head): the root
// keeps the final norm only; the gathered peak is the largest moment, not the root's whole tables
// beside the layers: in forward the embedding and the layer prefetched after it, in backward the
// root, the head (the last unit keeps its params) and the layer prefetched. A frozen embedding (a
// LoRA base) runs no backward: gathered once per step. A tied config cannot split.
TEST(Plan, AnEmbeddingAndHeadOfTheirOwnAreGatheredAroundTheirOwnWork) {
  llama::LlamaConfig c = mid();
  c.tie_word_embeddings = false;
  PlanRequest r = request(int64_t{8} << 30);
  r.micro_batch = 4;
  const LoraOptions lora = LoraOptions().r(8).base_dtype(FrozenStorage::kNF4);
  for (const LoraOptions* l : {static_cast<const LoraOptions*>(nullptr), &lora}) {
    const ModelShape whole = llama::plan_shape(c, l), split = llama::plan_shape(c, l, 0, true);
    ASSERT_EQ(split.units.size(), whole.units.size() + 2);
    EXPECT_EQ(split.numel(), whole.numel());
    EXPECT_EQ(split.units.front().numel(), c.hidden_size);  // the final norm
    EXPECT_EQ(split.units[1].name, "model.embed_tokens");
    EXPECT_EQ(split.units.back().name, "lm_head");
    const Plan a = plan(whole, r), b = plan(split, r);
    auto item = [](const PlanTier& t, const std::string& prefix) {
      for (const auto& [n, bytes] : t.items) {
        if (n.rfind(prefix, 0) == 0) return bytes;
      }
      return int64_t{-1};
    };
    const int64_t e = 2, table = c.vocab_size * c.hidden_size, layer = whole.units[1].numel();
    // Whole, the root's tables stay gathered to the end of backward and the layers count at the
    // start only (Note [Two moments of backward]); split, the peak is below what the units that are
    // not layers hold together, and is counted at both moments.
    EXPECT_EQ(item(a.device, "gathered params (the units that are not layers)"), e * (2 * table + c.hidden_size));
    auto at_start = [](const PlanTier& t, const std::string& prefix) {
      for (const auto& [n, bytes] : t.at_backward_start) {
        if (n.rfind(prefix, 0) == 0) return bytes;
      }
      return int64_t{-1};
    };
    // The layers beyond them: the last one, kept, in the loss's backward; with the one prefetched
    // in the first layer's backward (Note [Two moments of backward]), whichever is the larger moment.
    const int64_t at_loss = at_start(a.device, "in the loss's backward: layers' gathered params kept or prefetched");
    const int64_t at_peak =
        at_start(a.device, "in a layer's backward: gathered params beyond those, at their peak (root + 2 layer(s))");
    EXPECT_EQ(at_loss > 0 ? at_loss : at_peak, e * (at_loss > 0 ? 1 : 2) * layer) << a.to_string();
    EXPECT_EQ(item(b.device, "gathered params (root"), e * (c.hidden_size + table + layer));
    EXPECT_LT(b.device.total(), a.device.total()) << b.to_string();
    // Gathers per micro-batch: root 1, embedding 1 (frozen) or 2, each layer 2 (the head runs last), head 1.
    const int64_t layers = c.num_hidden_layers;
    EXPECT_EQ(b.gathers_per_step, 1 + (l ? 1 : 2) + 2 * layers + 1);
    EXPECT_EQ(a.gathers_per_step, 1 + 2 * layers - 1);
  }
  EXPECT_THROW(llama::plan_shape(mid(), nullptr, 0, true), ConfigError);
}

// Note [Two moments of backward]: a full fine-tune's end of backward (the root's reduction in
// flight) holds the root's gathered params and one layer's gradient buffer, not the layers'
// gathered params nor a second layer's buffer; those count at the start. With kept gathers the
// layers stay gathered after backward, so their params count at both moments.
TEST(Plan, TheEndOfBackwardHoldsNoLayerGatheredAndOneLayersGradient) {
  const ModelShape shape = llama::plan_shape(mid());
  PlanRequest r = request(int64_t{8} << 30);
  r.keep_gathered = false;
  r.seq_len = 8, r.batch_per_rank = 1;  // short: a layer's backward is the start's larger moment
  const Plan p = plan(shape, r);
  ASSERT_TRUE(p.fits) << p.to_string();
  const int64_t e = 2, root = shape.units.front().numel(), layer = shape.units[1].numel();
  auto find = [](const std::vector<std::pair<std::string, int64_t>>& v, const std::string& name) {
    for (const auto& [n, bytes] : v) {
      if (n == name) return bytes;
    }
    return int64_t{-1};
  };
  const PlanTier& ram = p.device;
  EXPECT_EQ(find(ram.items, "gathered params (the units that are not layers)"), e * root) << p.to_string();
  EXPECT_EQ(find(ram.at_backward_start,
                 "in a layer's backward: gathered params beyond those, at their peak (root + 2 layer(s))"),
            e * 2 * layer)
      << p.to_string();
  EXPECT_EQ(find(ram.items, "gradient buffers (root + 1 layer(s))"), e * (root + layer)) << p.to_string();
  EXPECT_EQ(find(ram.at_backward_start, "a second layer's gradient buffer (one filled, one reduced)"), e * layer)
      << p.to_string();
  // Kept gathers: the peak's gathered params throughout, nothing of them at the start alone.
  r.keep_gathered = true;
  const Plan kept = plan(shape, r);
  EXPECT_EQ(find(kept.device.items, "gathered params (root + 2 layer(s))"), e * (root + 2 * layer)) << kept.to_string();
  EXPECT_EQ(find(kept.device.at_backward_start,
                 "in a layer's backward: gathered params beyond those, at their peak (root + 2 layer(s))"),
            -1);
}

// Note [Two moments of backward]: the start of backward is the loss's backward (its transient, the
// layers kept from forward) or, after it, a layer's (the gathered params at their peak, a rebuilt
// checkpointed layer, its own transient); the plan counts the larger, never both.
TEST(Plan, TheStartOfBackwardCountsTheLossOrALayerNotBoth) {
  const ModelShape shape = llama::plan_shape(mid());
  const UnitShape& root = shape.units.front();
  const UnitShape& layer = shape.units[1];
  const int64_t e = 2, gathered = e * layer.numel();
  auto at_start = [](const Plan& p, const std::string& prefix) {
    int64_t bytes = 0;
    for (const auto& [n, b] : p.device.at_backward_start) bytes += n.rfind(prefix, 0) == 0 ? b : 0;
    return bytes;
  };
  PlanRequest r = request(int64_t{8} << 30);
  r.keep_gathered = false;
  r.checkpoint_every = 1;
  r.micro_batch = 1, r.batch_per_rank = 1;
  // The two moments' sizes at a sequence length: the loss's (the last layer, kept from forward, and
  // the loss's transient) and a layer's (two layers, one rebuilt, its transient).
  struct Moments {
    int64_t transient, rebuilt, layer_transient, loss, layer;
  };
  auto moments = [&](int64_t seq_len) {
    Moments m{root.backward_peak(1, seq_len, at::kBFloat16), layer.activations(1, seq_len, at::kBFloat16, false),
              layer.backward_peak(1, seq_len, at::kBFloat16), 0, 0};
    m.loss = gathered + m.transient;
    m.layer = 2 * gathered + m.rebuilt + m.layer_transient;
    return m;
  };
  // Long: the loss's gradients over 32,000 tokens of vocabulary outweigh a second layer.
  r.seq_len = 1024;
  const Plan loss = plan(shape, r);
  ASSERT_TRUE(loss.fits) << loss.to_string();
  const Moments long_seq = moments(r.seq_len);
  ASSERT_GT(long_seq.loss, long_seq.layer);
  EXPECT_EQ(at_start(loss, "in the loss's backward: layers' gathered params kept or prefetched"), gathered)
      << loss.to_string();  // the last layer, kept from forward
  EXPECT_EQ(at_start(loss, "in the loss's backward: its transient"), long_seq.transient);
  EXPECT_EQ(at_start(loss, "in a layer's backward"), 0) << loss.to_string();
  // Short: the next layer prefetched while the last one rebuilds its activations is the larger.
  r.seq_len = 16;
  const Plan layers = plan(shape, r);
  ASSERT_TRUE(layers.fits) << layers.to_string();
  const Moments short_seq = moments(r.seq_len);
  ASSERT_LT(short_seq.loss, short_seq.layer);
  EXPECT_EQ(at_start(layers, "in a layer's backward: gathered params beyond those"), 2 * gathered)
      << layers.to_string();
  EXPECT_EQ(at_start(layers, "in a layer's backward: one checkpointed unit's activations rebuilt"), short_seq.rebuilt);
  EXPECT_EQ(at_start(layers, "in a layer's backward: its transient"), short_seq.layer_transient);
  EXPECT_EQ(at_start(layers, "in the loss's backward"), 0) << layers.to_string();
  // Both count what forward kept: the checkpointed layers' inputs and the root's.
  EXPECT_EQ(
      at_start(layers, "activations kept from forward"),
      root.activations(1, r.seq_len, at::kBFloat16, false) + 4 * layer.activations(1, r.seq_len, at::kBFloat16, true));
}

// Replicated adapters: the trainable elements of every unit with frozen ones whole on every rank
// (master, gradient and both moments: 16 bytes each), all-reduced over every rank, never gathered.
TEST(Plan, ReplicatedAdaptersHoldTheirWholeStateAndAreAllReduced) {
  ModelShape shape;
  shape.units.push_back({"root", 0, 1000000, {}, nullptr, nullptr, 0, true, false});
  for (int i = 0; i < 3; ++i) shape.units.push_back({"layers." + std::to_string(i), 4000, 2000000});
  PlanRequest r = request(int64_t{8} << 30);
  r.micro_batch = 4;
  r.strategy = ShardingStrategy::kFullShard;
  r.offload = OffloadPolicy();
  const Plan sharded = plan(shape, r);
  r.replicate_adapters = true;
  const Plan replicated = plan(shape, r);
  ASSERT_TRUE(sharded.fits && replicated.fits);
  auto item = [](const PlanTier& t, const std::string& name) {
    for (const auto& [n, bytes] : t.items) {
      if (n == name) return bytes;
    }
    return int64_t{0};
  };
  const std::string states = "sharded states not offloaded";
  EXPECT_EQ(item(replicated.device, states) - item(sharded.device, states), 3 * 16 * (4000 - 2000));
  // bf16 shards gathered (2 bytes), fp32 reductions (4 bytes).
  EXPECT_EQ(sharded.all_gather_bytes - replicated.all_gather_bytes, 2 * 2000 * (2 * 2 + 1));
  // 3 reduce-scatters of 1 x 2000 against 3 all-reduces of 2 x 4000 x (2 - 1) / 2.
  EXPECT_EQ(replicated.reduce_bytes - sharded.reduce_bytes, 3 * 4 * (4000 - 2000));
  // bf16 compute casts a replicated adapter into a gathered copy; fp32 compute uses its master.
  auto gathered = [](const Plan& p) {  // at their peak: what the end of backward holds and the rest
    int64_t sum = 0;
    for (const auto* list : {&p.device.items, &p.device.at_backward_start}) {
      for (const auto& [n, bytes] : *list) {
        if (n.find("gathered params") != std::string::npos) sum += bytes;
      }
    }
    return sum;
  };
  EXPECT_EQ(gathered(replicated), gathered(sharded));
  r.param_dtype = at::kFloat;
  const Plan fp32_replicated = plan(shape, r);
  r.replicate_adapters = false;
  const Plan fp32_sharded = plan(shape, r);
  EXPECT_EQ(gathered(fp32_sharded) - gathered(fp32_replicated), 4 * 2 * 4000) << fp32_replicated.to_string();
}

// Under hybrid sharding each way of accumulating costs what it moves: no_sync keeps the unsharded
// gradients and reduces once; reduce_scatter scatters every micro-batch, all-reduces once and
// holds an fp32 partial sum per shard; reduce does both every micro-batch.
TEST(Plan, AccumulationUnderHybridShardingCountsItsBytes) {
  const ModelShape shape = llama::plan_shape(mid());
  PlanRequest r = request(int64_t{8} << 30);
  r.ranks_per_node = 2;
  r.nodes = 2;
  r.strategy = ShardingStrategy::kHybridShard;
  r.micro_batch = 1;  // 4 micro-batches
  r.keep_gathered = false;
  r.reduce_dtype = at::kFloat;
  std::map<Accumulation, Plan> p;
  for (auto a : {Accumulation::kNoSync, Accumulation::kReduceScatter, Accumulation::kReduce}) {
    r.accumulation = a;
    p[a] = plan(shape, r);
    ASSERT_TRUE(p[a].fits) << p[a].to_string();
  }
  int64_t shards = 0;
  for (const auto& u : shape.units) shards += (u.trainable_numel + 1) / 2;
  const int64_t scatter = 4 * shards;             // one hop of fp32 shards
  const int64_t all_reduce = 2 * 4 * shards / 2;  // 2 x shard x (replicas - 1) / replicas
  EXPECT_EQ(p[Accumulation::kNoSync].reduce_bytes, scatter + all_reduce);
  EXPECT_EQ(p[Accumulation::kReduceScatter].reduce_bytes, 4 * scatter + all_reduce);
  EXPECT_EQ(p[Accumulation::kReduce].reduce_bytes, 4 * (scatter + all_reduce));
  auto has = [](const Plan& plan, const std::string& prefix) {
    for (const auto& [n, bytes] : plan.device.items) {
      if (n.rfind(prefix, 0) == 0) return bytes;
    }
    return int64_t{0};
  };
  EXPECT_GT(has(p[Accumulation::kNoSync], "unreduced gradients"), 0);
  EXPECT_EQ(has(p[Accumulation::kReduceScatter], "unreduced gradients"), 0);
  EXPECT_EQ(has(p[Accumulation::kReduceScatter], "partial gradient sums"), 4 * shards);
  EXPECT_EQ(has(p[Accumulation::kReduce], "partial gradient sums"), 0);
  EXPECT_EQ(has(p[Accumulation::kReduce], "unreduced gradients"), 0);
  EXPECT_EQ(parse_accumulation("reduce_scatter"), Accumulation::kReduceScatter);
  EXPECT_THROW(parse_accumulation("sometimes"), ConfigError);
}

TEST(Plan, WhatFitsNothingSaysWhatIsShortAndByHowMuch) {
  const ModelShape shape = llama::plan_shape(qwen_like(true));
  const Plan p = plan(shape, request(50 << 20));  // less than the process itself
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.shortfall.find("RAM: needs"), std::string::npos) << p.shortfall;
  const int64_t short_by = p.device.total() - (50 << 20);
  EXPECT_NE(p.shortfall.find("short by"), std::string::npos) << p.shortfall;
  EXPECT_NE(p.shortfall.find("(" + std::to_string(short_by) + " bytes)"), std::string::npos) << p.shortfall;
  EXPECT_NE(p.shortfall.find("Lever"), std::string::npos) << p.shortfall;
  EXPECT_NE(p.to_string().find("does NOT fit"), std::string::npos);

  // A config's choices that do not fit name settings that would.
  PlanRequest fixed = request(0);
  fixed.budget.host_bytes = plan(shape, request(int64_t{8} << 30)).device.total() - (1 << 20);
  fixed.offload = OffloadPolicy();
  fixed.checkpoint_every = 0;
  fixed.micro_batch = 4;
  const Plan q = plan(shape, fixed);
  EXPECT_FALSE(q.fits);
  EXPECT_NE(q.shortfall.find("Lever: these settings fit:"), std::string::npos) << q.shortfall;
}

TEST(Plan, MalformedRequestsAreConfigErrorsNamingTheField) {
  const ModelShape shape = llama::plan_shape(qwen_like(false));
  auto error_of = [&](PlanRequest r) -> std::string {
    try {
      plan(shape, r);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  PlanRequest r = request(1 << 30);
  r.ranks_per_node = 0;
  EXPECT_NE(error_of(r).find("ranks_per_node"), std::string::npos);
  r = request(1 << 30);
  r.batch_per_rank = 0;
  EXPECT_NE(error_of(r).find("batch_per_rank"), std::string::npos);
  r = request(1 << 30);
  r.micro_batch = 8;  // above batch_per_rank 4
  EXPECT_NE(error_of(r).find("micro_batch"), std::string::npos);
  r = request(-1);
  EXPECT_NE(error_of(r).find("budget"), std::string::npos);
  EXPECT_NE(error_of(PlanRequest{}).find("(accepted)"), std::string::npos);  // defaults are valid
  ModelShape empty;
  EXPECT_THROW(plan(empty, request(1 << 30)), ConfigError);
  r = request(1 << 30);
  r.margin = 0.95;
  EXPECT_NE(error_of(r).find("margin must be in [0, 0.9]"), std::string::npos) << error_of(r);
  r = request(1 << 30);
  r.seq_len = int64_t{1} << 30, r.batch_per_rank = 1 << 10;
  EXPECT_NE(error_of(r).find("2^36 tokens"), std::string::npos) << error_of(r);
}

// A user's shape whose figures leave 64 bits is refused, never printed as a negative fit.
TEST(Plan, FiguresBeyondSixtyFourBitsAreRefusedNotWrapped) {
  auto error_of = [](const ModelShape& shape, const PlanRequest& r) -> std::string {
    try {
      plan(shape, r);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  ModelShape huge;
  huge.units.resize(2);
  huge.units[0].name = "root", huge.units[0].is_root = true, huge.units[0].trainable_numel = int64_t{1} << 51;
  huge.units[1].name = "layer", huge.units[1].trainable_numel = 1000;
  EXPECT_NE(error_of(huge, request(1 << 30)).find("more than 2^50"), std::string::npos)
      << error_of(huge, request(1 << 30));
  ModelShape acts;
  acts.units.resize(3);
  for (int i = 0; i < 3; ++i) {
    acts.units[i].name = "u" + std::to_string(i), acts.units[i].trainable_numel = 1000, acts.units[i].is_root = i == 0;
    acts.units[i].activations = [](int64_t, int64_t, at::ScalarType, bool) { return int64_t{1} << 62; };
  }
  EXPECT_NE(error_of(acts, request(1 << 30)).find("overflows 64-bit bytes"), std::string::npos)
      << error_of(acts, request(1 << 30));
}

// The margin is held free when choosing: a budget that the plain plan fits within, but not within
// 90% of it, gets a cheaper choice (or no fit) at a 10% margin, and the plan prints the margin.
TEST(Plan, TheMarginIsHeldFreeWhenChoosing) {
  const ModelShape shape = llama::plan_shape(qwen_like(true));
  const int64_t need = plan(shape, request(int64_t{8} << 30)).device.total();
  PlanRequest r = request(need + need / 20);  // 5% above what the fastest choice needs
  const Plan plain = plan(shape, r);
  EXPECT_TRUE(plain.fits);
  EXPECT_EQ(plain.device.total(), need);
  EXPECT_EQ(plain.margin_bytes, 0);
  r.margin = 0.10;
  const Plan held = plan(shape, r);
  EXPECT_EQ(held.margin_bytes, static_cast<int64_t>(static_cast<double>(r.budget.host_bytes) * 0.10));
  if (held.fits) {
    EXPECT_LE(held.device.total(), r.budget.host_bytes - held.margin_bytes) << held.to_string();
    EXPECT_LT(held.device.total(), need) << held.to_string();
  } else {
    EXPECT_NE(held.shortfall.find("the budget (host less the margin)"), std::string::npos) << held.shortfall;
  }
  EXPECT_NE(held.to_string().find("margin held free"), std::string::npos) << held.to_string();
}

}  // namespace
}  // namespace fsdp
