// The memory plan: model state by tier, the largest gathered unit, and the memory levers.
#include "memory_plan.h"

#include "base/strings.h"

namespace train {
namespace {

using fsdp::base::mib;

// One RMSNorm's saved tensors over N tokens: the normalised input and the scaled output in the
// compute dtype, plus the fp32 copy of its input when computing in a narrower dtype.
int64_t norm_bytes(int64_t N, int64_t H, int64_t e) { return 2 * e * N * H + (e != 4 ? 4 * N * H : 0); }

}  // namespace

// Note [Activation bytes]
// What autograd keeps from forward to backward, counted from the model's operations
// (models/llama): per layer, the two norms (norm_bytes), the residual sum after attention and the
// layer's output (N*H each); for attention, q, k and v after the rotary embedding and the key/value
// head repeat, and the attention output that o_proj saves (4 * N * heads * head_dim), plus Qwen3's
// q/k norms over each head; then what the attention kernel itself keeps: with
// at::scaled_dot_product_attention (attn_implementation "sdpa") the fused kernel's log-sum-exp,
// B * heads * T in fp32, and with the eager path the softmax probabilities, B * heads * T^2 in fp32
// plus their copy in the compute dtype; a sliding window adds its boolean mask (T^2). For the MLP:
// gate, silu(gate), up and their product (4 * N * I). Tensors used only by a multiplication with a
// constant (the rotary tables) or by an addition are not kept. The root keeps the embedding output,
// the final norm and the loss's log-probabilities (fp32, N * vocab).
int64_t layer_activation_bytes(const llama::LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t N = batch * seq_len, H = m.hidden_size, I = m.intermediate_size;
  const int64_t heads = m.num_attention_heads, q = heads * m.head_dim();
  const int64_t kv = m.num_key_value_heads * m.head_dim();
  const bool sdpa = m.attn_implementation == "sdpa";
  const int64_t attn_kernel = sdpa ? 4 * batch * heads * seq_len  // log-sum-exp
                                   : batch * heads * seq_len * seq_len * (4 + (e != 4 ? e : 0)) +
                                         seq_len * seq_len;  // probabilities, the causal mask
  const int64_t window_mask = sdpa && m.sliding_window > 0 ? seq_len * seq_len : 0;
  const int64_t qk_norms = m.qk_norm() ? norm_bytes(N, q, e) + norm_bytes(N, kv, e) : 0;
  return 2 * norm_bytes(N, H, e) + 2 * e * N * H + 4 * e * N * q + qk_norms + attn_kernel + window_mask + 4 * e * N * I;
}

int64_t root_activation_bytes(const llama::LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t N = batch * seq_len;
  return e * N * m.hidden_size + norm_bytes(N, m.hidden_size, e) + 4 * N * m.vocab_size;
}

MemoryPlan predict_memory(const llama::LlamaConfig& m, at::ScalarType param_dtype, int shard_size,
                          const fsdp::OffloadPolicy& offload) {
  PlanInputs in;
  in.model = m;
  in.param_dtype = param_dtype;
  in.shard_size = shard_size;
  in.offload = offload;
  return plan_memory(in);
}

MemoryPlan plan_memory(const PlanInputs& in) {
  const auto& m = in.model;
  const llama::ParamCounts c = llama::param_counts(m);
  MemoryPlan p;
  p.shard_size = in.shard_size;
  p.num_params = c.total(m);
  const int64_t per_rank = (p.num_params + in.shard_size - 1) / in.shard_size;
  p.params = 4 * per_rank;
  p.grads = 4 * per_rank;
  p.optimizer = 8 * per_rank;
  const int64_t by_state[3] = {p.params, p.grads, p.optimizer};
  const fsdp::OffloadTier tiers[3] = {in.offload.params(), in.offload.grads(), in.offload.optimizer_state()};
  for (int k = 0; k < 3; ++k) {
    const fsdp::OffloadTier t = tiers[k];
    int64_t& tier = t == fsdp::OffloadTier::kDisk   ? p.tier_disk
                    : t == fsdp::OffloadTier::kHost ? p.tier_host
                                                    : p.tier_ram;
    tier += by_state[k];
  }
  const bool root_largest = c.root >= c.per_layer;
  p.largest_unit = root_largest ? "root: embedding, final norm, lm_head" : "one decoder layer";
  const int64_t elem = static_cast<int64_t>(c10::elementSize(in.param_dtype));
  p.gathered_params = elem * (root_largest ? c.root : c.per_layer);
  p.gathered_grads = p.gathered_params;

  if (in.micro_batch > 0 && in.seq_len > 0) {
    const int64_t L = m.num_hidden_layers, B = in.micro_batch, T = in.seq_len;
    const int64_t full = layer_activation_bytes(m, B, T, in.param_dtype);
    const int64_t n = in.checkpoint_every;
    p.checkpointed_layers = n > 0 ? (L + n - 1) / n : 0;  // layers 0, n, 2n, ...
    // A checkpointed layer keeps only its output (its input is the previous layer's output).
    const int64_t kept = elem * B * T * m.hidden_size;
    p.activations = root_activation_bytes(m, B, T, in.param_dtype) + (L - p.checkpointed_layers) * full +
                    p.checkpointed_layers * kept;
    p.recompute = p.checkpointed_layers > 0 ? full : 0;
  }
  // No-sync accumulation keeps every unit's unsharded gradient buffer (param_dtype).
  if (in.grad_accum_steps > 1) p.accum_grads = elem * p.num_params;
  // The snapshot copies this rank's fp32 params and optimizer state (not the gradients).
  if (in.async_save) p.async_snapshot = p.params + p.optimizer;
  return p;
}

int64_t MemoryPlan::total() const {
  int64_t t =
      tier_ram + tier_host + gathered_params + gathered_grads + activations + recompute + accum_grads + async_snapshot;
  for (const auto& [name, bytes] : extra) t += bytes;
  return t;
}

std::string MemoryPlan::to_string() const {
  std::string s = std::to_string(num_params) + " params over " + std::to_string(shard_size) + " shard(s): params " +
                  mib(params) + ", grads " + mib(grads) + ", AdamW " + mib(optimizer) + ", largest unit (" +
                  largest_unit + ") gathered: params " + mib(gathered_params) + " + grads " + mib(gathered_grads);
  if (tier_host + tier_disk > 0) {
    s += "; sharded state by tier: RAM " + mib(tier_ram) + ", host " + mib(tier_host) + ", disk " + mib(tier_disk);
  }
  if (activations > 0) {
    s += "; activations " + mib(activations);
    if (checkpointed_layers > 0) {
      s += " (" + std::to_string(checkpointed_layers) + " layer(s) checkpointed, + " + mib(recompute) +
           " recomputed in backward)";
    }
  }
  if (accum_grads > 0) s += "; accumulated gradients " + mib(accum_grads);
  if (async_snapshot > 0) s += "; async save snapshot " + mib(async_snapshot);
  for (const auto& [name, bytes] : extra) s += "; " + name + " " + mib(bytes);
  if (activations > 0) s += "; total " + mib(total());
  return s;
}

nlohmann::json lever_report(const MemoryPlan& plan, const MeasuredLevers& got) {
  nlohmann::json j = nlohmann::json::object();
  auto add = [&](const char* name, int64_t planned, int64_t measured) {
    if (planned <= 0 || measured < 0) return;
    j[name] = {{"plan", planned},
               {"measured", measured},
               {"error", static_cast<double>(measured - planned) / static_cast<double>(planned)}};
  };
  add("activations", plan.activations, got.activations);
  add("accumulated_gradients", plan.accum_grads, got.accum_grads);
  add("async_snapshot", plan.async_snapshot, got.async_snapshot);
  return j;
}

std::string levers_summary(const TrainConfig& cfg, int64_t global_batch) {
  const auto& t = cfg.train;
  std::string s = "levers: activation checkpointing ";
  s += t.activation_checkpointing == 0   ? "off"
       : t.activation_checkpointing == 1 ? "every layer"
                                         : "every " + std::to_string(t.activation_checkpointing) + " layers";
  s += "; " + std::to_string(t.grad_accum_steps) + " micro-batch(es) of " +
       std::to_string(cfg.data.batch_size_per_rank) + " per rank per step (" + std::to_string(global_batch) +
       " samples per step)";
  s += std::string("; checkpoints ") + (t.async_save ? "saved in the background" : "saved synchronously");
  s += cfg.fsdp.loss_scaling() ? "; dynamic loss scaling from " + nlohmann::json(cfg.fsdp.scaler.init_scale()).dump()
                               : std::string("; no loss scaling");
  const int64_t max_skips = cfg.fsdp.scaler.max_consecutive_skips();
  s += "; non-finite steps skipped" +
       (max_skips > 0 ? ", " + std::to_string(max_skips) + " in a row stop the run" : std::string(", never stopping"));
  return s;
}

}  // namespace train
