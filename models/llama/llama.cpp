// The decoder of llama.h: the modules, loss and init rules (the config is in config.cpp).
// Numerics mirror transformers' modeling_llama.py (and its Qwen2, Qwen3 and Mistral variants) line
// for line where the order of floating-point operations matters; those places say so.
#include "llama.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "fsdp/checkpoint_activations.h"
#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/init.h"
#include "fsdp/lora.h"
#include "fsdp/loss.h"
#include "fsdp/vocab_parallel.h"

namespace llama {
namespace {

// Names in module order, each tensor once; see Note [Tied embeddings].
std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Matches every RMSNorm weight: "model.norm.weight", "...input_layernorm.weight" and "...q_norm.weight"
// alike.
constexpr const char* kNormSuffix = "norm.weight";
constexpr const char* kBiasSuffix = ".bias";

// transformers' masking: query i sees key j when j <= i and, with a sliding window W, i - j < W.
at::Tensor allowed_mask(int64_t T, int64_t sliding_window, const at::Device& device) {
  const auto i = at::arange(T, at::TensorOptions().device(device).dtype(at::kLong)).unsqueeze(1);
  const auto j = i.transpose(0, 1);
  auto allowed = j.le(i);
  if (sliding_window > 0) allowed = allowed.logical_and(i - j < sliding_window);
  return allowed;
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// transformers' repeat_kv: [B, KV, T, D] -> [B, KV * n_rep, T, D], each key/value head repeated
// n_rep times in a row, so query head h reads key/value head h / n_rep.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const auto B = x.size(0), KV = x.size(1), T = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, KV, n_rep, T, D}).reshape({B, KV * n_rep, T, D});
}

}  // namespace

// ---- building blocks ---------------------------------------------------------------------------

BiasFreeLinearImpl::BiasFreeLinearImpl(int64_t in_features, int64_t out_features, at::Device device)
    : weight(register_parameter("weight", at::empty({out_features, in_features}, at::TensorOptions().device(device)))) {
}

BiasFreeLinearImpl::BiasFreeLinearImpl(at::Tensor shared_weight)
    : weight(register_parameter("weight", std::move(shared_weight))) {}

at::Tensor BiasFreeLinearImpl::forward(const at::Tensor& x, const at::Tensor& targets, int64_t chunk_tokens) {
  if (chunk_tokens > 0) return fsdp::chunked_cross_entropy(x, weight, targets, chunk_tokens);
  return at::linear(x, weight);
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias, at::Device device)
    : weight(register_parameter("weight", at::empty({out_features, in_features}, at::TensorOptions().device(device)))) {
  if (with_bias) bias = register_parameter("bias", at::empty({out_features}, at::TensorOptions().device(device)));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) { return at::linear(x, weight, bias); }

// Both Linears pass their `weight` member to at::linear: fsdp::lora may adapt them.
namespace {
const bool kLinearsDeclared = [] {
  fsdp::register_linear_type<LinearImpl>([](LinearImpl& m) { return &m.weight; });
  fsdp::register_linear_type<BiasFreeLinearImpl>([](BiasFreeLinearImpl& m) { return &m.weight; });
  return true;
}();
}  // namespace

TokenEmbeddingImpl::TokenEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, at::Device device)
    : weight(register_parameter("weight",
                                at::empty({num_embeddings, embedding_dim}, at::TensorOptions().device(device)))) {}

at::Tensor TokenEmbeddingImpl::forward(const at::Tensor& tokens) { return at::embedding(weight, tokens); }

RMSNormImpl::RMSNormImpl(int64_t hidden_size, double eps, at::Device device)
    : weight(register_parameter("weight", at::empty({hidden_size}, at::TensorOptions().device(device)))), eps_(eps) {}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // As LlamaRMSNorm: normalise in fp32, cast back, then scale (the scale multiply is in the
  // parameter's dtype, not fp32).
  const auto input_dtype = x.scalar_type();
  auto h = x.to(at::kFloat);
  const auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps_);
  return weight * h.to(input_dtype);
}

at::Tensor rotary_inv_freq(int64_t head_dim, double rope_theta, const RopeScaling& scaling, const at::Device& device) {
  // As transformers' default rope init: inv_freq = 1 / theta^(2i / d), computed in fp32.
  const auto opts = at::TensorOptions().device(device);
  const auto exponent = at::arange(0, head_dim, 2, opts.dtype(at::kLong)).to(at::kFloat) / head_dim;
  const auto inv_freq = at::reciprocal(at::pow(rope_theta, exponent));
  if (scaling.rope_type != "llama3") return inv_freq;
  // _compute_llama3_parameters, step for step: long wavelengths divided by factor, short ones
  // kept, the band between interpolated by a smooth factor.
  const double old_len = static_cast<double>(scaling.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / scaling.low_freq_factor;
  const double high_freq_wavelen = old_len / scaling.high_freq_factor;
  const auto wavelen = 2 * M_PI / inv_freq;
  auto scaled = at::where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq);
  const auto smooth =
      (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor);
  const auto smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled;
  const auto medium = wavelen.ge(high_freq_wavelen).logical_and(wavelen.le(low_freq_wavelen));
  return at::where(medium, smoothed, scaled);
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(int64_t head_dim, double rope_theta, const at::Tensor& positions,
                                                 at::ScalarType dtype, const RopeScaling& scaling) {
  TORCH_CHECK(positions.dim() == 1, "rotary_cos_sin expects positions [T], got ", positions.sizes());
  // Same operations, in the same order and in fp32, as LlamaRotaryEmbedding: angles = position *
  // inv_freq, duplicated to [cos(a), cos(a)] (llama3's attention factor is 1).
  const auto inv_freq = rotary_inv_freq(head_dim, rope_theta, scaling, positions.device());
  const auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  const auto angles = at::cat({freqs, freqs}, -1);
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config, at::Device device)
    : num_heads_(config.num_attention_heads),
      num_kv_heads_(config.num_key_value_heads),
      head_dim_(config.head_dim()),
      sliding_window_(config.sliding_window),
      sdpa_(config.attn_implementation == "sdpa") {
  const int64_t hidden = config.hidden_size;
  // Registration order is transformers': the projections, then the q/k norms.
  q_proj = register_module("q_proj", Linear(hidden, num_heads_ * head_dim_, config.qkv_bias(), device));
  k_proj = register_module("k_proj", Linear(hidden, num_kv_heads_ * head_dim_, config.qkv_bias(), device));
  v_proj = register_module("v_proj", Linear(hidden, num_kv_heads_ * head_dim_, config.qkv_bias(), device));
  o_proj = register_module("o_proj", Linear(num_heads_ * head_dim_, hidden, config.o_bias(), device));
  if (config.qk_norm()) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, config.rms_norm_eps, device));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, config.rms_norm_eps, device));
  }
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1);
  auto q = q_proj(x).view({B, T, num_heads_, head_dim_});
  auto k = k_proj(x).view({B, T, num_kv_heads_, head_dim_});
  if (q_norm) {  // Qwen3: per head, before the rotary embedding
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_rotary(q.transpose(1, 2), cos, sin);  // [B, H, T, D]
  k = apply_rotary(k.transpose(1, 2), cos, sin);
  auto v = v_proj(x).view({B, T, num_kv_heads_, head_dim_}).transpose(1, 2);
  k = repeat_kv(k, num_heads_ / num_kv_heads_);
  v = repeat_kv(v, num_heads_ / num_kv_heads_);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));

  at::Tensor out;
  if (sdpa_) {
    // As transformers' sdpa_attention_forward: is_causal without a sliding window, else a boolean
    // mask (true: attend).
    std::optional<at::Tensor> mask;
    if (sliding_window_ > 0) mask = allowed_mask(T, sliding_window_, x.device());
    out = at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/!mask.has_value(), scale);
  } else {
    // transformers' eager attention: scores in the input dtype, softmax in fp32. A masked score
    // of -inf and transformers' additive dtype-min both give exactly 0 after softmax.
    auto scores = at::matmul(q, k.transpose(2, 3)) * scale;
    const auto masked = allowed_mask(T, sliding_window_, x.device()).logical_not();
    scores = scores.masked_fill(masked, -std::numeric_limits<double>::infinity());
    const auto probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    out = at::matmul(probs, v);
  }
  return o_proj(out.transpose(1, 2).reshape({B, T, num_heads_ * head_dim_}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& config, at::Device device) {
  gate_proj = register_module("gate_proj", BiasFreeLinear(config.hidden_size, config.intermediate_size, device));
  up_proj = register_module("up_proj", BiasFreeLinear(config.hidden_size, config.intermediate_size, device));
  down_proj = register_module("down_proj", BiasFreeLinear(config.intermediate_size, config.hidden_size, device));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config, at::Device device) {
  // Registration order is transformers' (attention, mlp, then the norms), so named_parameters()
  // lists names in the same order as its state_dict.
  self_attn = register_module("self_attn", LlamaAttention(config, device));
  mlp = register_module("mlp", LlamaMLP(config, device));
  input_layernorm = register_module("input_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps, device));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps, device));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto h = x + self_attn(input_layernorm(x), cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

// ---- the model ---------------------------------------------------------------------------------

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config, at::Device device) : config_(config) {
  config_.validate();
  embed_tokens = register_module("embed_tokens", TokenEmbedding(config.vocab_size, config.hidden_size, device));
  layers_list_ = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    LlamaDecoderLayer layer(config, device);
    layers_list_->push_back(layer);  // registered as "i"
    layers.push_back(layer);
  }
  norm = register_module("norm", RMSNorm(config.hidden_size, config.rms_norm_eps, device));
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "Llama expects tokens of shape [B, T] and ",
              "dtype int64, got shape ", tokens.sizes(), " and dtype ", tokens.scalar_type());
  const int64_t T = tokens.size(1);
  TORCH_CHECK(T <= config_.max_position_embeddings, "Llama got a sequence of length ", T,
              " > max_position_embeddings=", config_.max_position_embeddings,
              "; raise max_position_embeddings in the config to run longer sequences");
  auto h = vocab_parallel ? fsdp::sharded_embedding(*embed_tokens, tokens) : fsdp::call(embed_tokens, tokens);
  // One rotary table for all layers, in the activations' dtype (as transformers passes
  // position_embeddings down). Under mixed precision fsdp::call casts it with the activations.
  const auto [cos, sin] = rotary_cos_sin(config_.head_dim(), config_.rope_theta, at::arange(T, tokens.options()),
                                         h.scalar_type(), config_.rope_scaling);
  for (size_t i = 0; i < layers.size(); ++i) {
    if (checkpoint_every > 0 && static_cast<int64_t>(i) % checkpoint_every == 0) {
      // Captured by value: the function runs again inside backward, after this forward returned.
      h = fsdp::checkpoint_activations([layer = layers[i], cos = cos, sin = sin](
                                           const at::Tensor& x) mutable { return fsdp::call(layer, x, cos, sin); },
                                       h);
    } else {
      h = fsdp::call(layers[i], h, cos, sin);
    }
  }
  return norm(h);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& config, at::Device device) : config_(config) {
  model = register_module("model", LlamaModel(config, device));
  // See Note [Tied embeddings].
  lm_head = config.tie_word_embeddings
                ? register_module("lm_head", BiasFreeLinear(model->embed_tokens->weight))
                : register_module("lm_head", BiasFreeLinear(config.hidden_size, config.vocab_size, device));
  if (!device.is_meta()) init_weights();
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& tokens) {
  if (vocab_parallel()) {
    throw fsdp::UsageError(
        "LlamaForCausalLM: the head is a vocab-parallel table (shard_vocab_parallel), so no rank holds every "
        "logit; compute the loss with forward(tokens, targets)");
  }
  return fsdp::call(lm_head, fsdp::call(model, tokens));
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& tokens, const at::Tensor& targets) {
  const at::Tensor h = fsdp::call(model, tokens);
  if (vocab_parallel()) {
    const torch::nn::Module& table =
        config_.tie_word_embeddings ? static_cast<const torch::nn::Module&>(*model->embed_tokens) : *lm_head;
    return fsdp::sharded_cross_entropy(table, h, targets);
  }
  if (loss_chunk_tokens_ == 0) return loss(fsdp::call(lm_head, h), targets);
  TORCH_CHECK(targets.dim() == 2 && targets.sizes() == tokens.sizes(), "LlamaForCausalLM expects targets of the ",
              "tokens' shape ", tokens.sizes(), ", got ", targets.sizes());
  return fsdp::call(lm_head, h, targets, loss_chunk_tokens_);
}

void shard_embedding_and_head(LlamaForCausalLM& model, fsdp::DeviceMesh& mesh, const fsdp::FullyShardOptions& options) {
  if (!can_shard_embedding_and_head(model->config())) {
    throw fsdp::ConfigError(
        "llama::shard_embedding_and_head: tie_word_embeddings is true, so lm_head.weight is "
        "model.embed_tokens.weight and the two cannot be units of their own; leave them in the root");
  }
  fsdp::fully_shard(model->model->embed_tokens, mesh, options);
  fsdp::fully_shard(model->lm_head, mesh, options);
}

bool can_shard_vocab_parallel(const LlamaForCausalLM& model) {
  const bool tied = model->config().tie_word_embeddings;
  return !model->model->embed_tokens->weight.requires_grad() && model->lm_head->named_parameters().size() == 1 &&
         (tied || !model->lm_head->weight.requires_grad());
}

void shard_vocab_parallel(LlamaForCausalLM& model, fsdp::DeviceMesh& mesh, fsdp::FullyShardOptions options) {
  if (!can_shard_vocab_parallel(model)) {
    throw fsdp::ConfigError(
        "llama::shard_vocab_parallel: the embedding and the head must be frozen (a LoRA base) and the head a plain "
        "weight (no adapters on lm_head); shard them with the root or as units of their own instead");
  }
  options.vocab_parallel(true);
  fsdp::fully_shard(model->model->embed_tokens, mesh, options);
  if (!model->config().tie_word_embeddings) fsdp::fully_shard(model->lm_head, mesh, options);
  model->model->vocab_parallel = true;
}

void LlamaForCausalLMImpl::set_loss_chunk_tokens(int64_t tokens) {
  if (tokens < 0) {
    throw fsdp::ConfigError("LlamaForCausalLM: loss_chunk_tokens must be 0 (whole logits) or positive, got " +
                            std::to_string(tokens));
  }
  // The chunked loss multiplies by lm_head.weight itself: adapters on the head would be skipped.
  if (tokens > 0 && lm_head->named_parameters().size() != 1) {
    throw fsdp::ConfigError("LlamaForCausalLM: a chunked loss (loss_chunk_tokens " + std::to_string(tokens) +
                            ") needs lm_head to be a plain weight, but it has " +
                            std::to_string(lm_head->named_parameters().size()) +
                            " parameters (LoRA on lm_head?); leave lm_head out of the adapters' targets or "
                            "set loss_chunk_tokens to 0");
  }
  loss_chunk_tokens_ = tokens;
}

void LlamaForCausalLMImpl::init_weights() {
  at::NoGradGuard no_grad;
  for (auto& [name, param] : unique_named_parameters(*this)) {
    if (ends_with(name, kNormSuffix)) {
      param.fill_(1.0);
    } else if (ends_with(name, kBiasSuffix)) {
      param.zero_();
    } else {
      param.normal_(0.0, config_.initializer_range);
    }
  }
}

at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(
      logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) && logits.size(1) == targets.size(1),
      "llama::loss expects logits [B, T, V] and targets [B, T], got ", logits.sizes(), " and ", targets.sizes());
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(2)}), targets.reshape({-1}));
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (auto& named : unique_named_parameters(module)) out.push_back(std::move(named.second));
  return out;
}

fsdp::ParamInitFn llama_init_fn(const LlamaConfig& config, uint64_t seed) {
  return fsdp::init::by_suffix({{kNormSuffix, fsdp::init::constant(1.0)}, {kBiasSuffix, fsdp::init::constant(0.0)}},
                               fsdp::init::normal(config.initializer_range, seed));
}

}  // namespace llama
