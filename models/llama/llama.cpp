// The Llama decoder of llama.h: config parsing and validation, the modules, loss and init rules.
// Numerics mirror transformers' modeling_llama.py (eager attention) line for line where the order
// of floating-point operations matters; those places say so.
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
#include "fsdp/fully_shard.h"
#include "fsdp/init.h"

namespace llama {
namespace {

using nlohmann::json;

// replace: a string that is not UTF-8 must not make the error path throw (found by fuzz_config).
std::string show(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

[[noreturn]] void reject(const std::string& key, const json& value, const std::string& why) {
  throw std::invalid_argument("LlamaConfig: " + key + "=" + show(value) + " " + why);
}

// One table drives to_json, from_json and the list of known keys, so they cannot drift apart.
struct IntKey {
  const char* name;
  int64_t LlamaConfig::*field;
};
struct DoubleKey {
  const char* name;
  double LlamaConfig::*field;
};
constexpr IntKey kIntKeys[] = {
    {"vocab_size", &LlamaConfig::vocab_size},
    {"hidden_size", &LlamaConfig::hidden_size},
    {"intermediate_size", &LlamaConfig::intermediate_size},
    {"num_hidden_layers", &LlamaConfig::num_hidden_layers},
    {"num_attention_heads", &LlamaConfig::num_attention_heads},
    {"num_key_value_heads", &LlamaConfig::num_key_value_heads},
    {"max_position_embeddings", &LlamaConfig::max_position_embeddings},
};
constexpr DoubleKey kDoubleKeys[] = {
    {"rms_norm_eps", &LlamaConfig::rms_norm_eps},
    {"rope_theta", &LlamaConfig::rope_theta},
    {"initializer_range", &LlamaConfig::initializer_range},
};
constexpr const char* kTieKey = "tie_word_embeddings";

std::string known_keys() {
  std::string keys;
  for (const auto& k : kIntKeys) keys += std::string(k.name) + ", ";
  for (const auto& k : kDoubleKeys) keys += std::string(k.name) + ", ";
  return keys + kTieKey + ", rope_parameters";
}

int64_t parse_int(const std::string& key, const json& value) {
  const bool too_big =
      value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (!value.is_number_integer() || too_big) reject(key, value, "must be an integer");
  return value.get<int64_t>();
}

double parse_double(const std::string& key, const json& value) {
  if (!value.is_number()) reject(key, value, "must be a number");
  return value.get<double>();
}

// transformers >= 5 writes {"rope_type": "default", "rope_theta": x} under rope_parameters instead
// of a top-level rope_theta. Only the default (unscaled) rotary embedding is implemented, so any
// other rope_type, and any scaling key, is refused rather than silently ignored.
std::optional<double> parse_rope_parameters(const json& value) {
  if (!value.is_object()) reject("rope_parameters", value, "must be an object");
  // rope_type first: for a scaled rope it is the informative rejection.
  if (value.contains("rope_type") && value["rope_type"] != "default") {
    reject("rope_parameters.rope_type", value["rope_type"],
           "is not supported: only \"default\" (unscaled) rotary embeddings are");
  }
  std::optional<double> theta;
  for (const auto& [key, v] : value.items()) {
    if (key == "rope_theta") {
      theta = parse_double("rope_parameters.rope_theta", v);
    } else if (key != "rope_type") {
      reject("rope_parameters." + key, v, "is not supported: only rope_type and rope_theta are");
    }
  }
  return theta;
}

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

// Matches every RMSNorm weight: "model.norm.weight" and "...input_layernorm.weight" alike.
constexpr const char* kNormSuffix = "norm.weight";

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

// ---- config ------------------------------------------------------------------------------------

void LlamaConfig::validate() const {
  for (const auto& k : kIntKeys) {
    if (this->*k.field <= 0) reject(k.name, this->*k.field, "must be positive");
  }
  if (hidden_size % num_attention_heads != 0) {
    reject("hidden_size", hidden_size,
           "is not divisible by num_attention_heads=" + std::to_string(num_attention_heads));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    reject("num_attention_heads", num_attention_heads,
           "is not divisible by num_key_value_heads=" + std::to_string(num_key_value_heads));
  }
  if (head_dim() % 2 != 0) {
    reject("hidden_size", hidden_size,
           "gives head_dim=" + std::to_string(head_dim()) +
               " (hidden_size / num_attention_heads), which must be "
               "even for rotary embeddings");
  }
  for (const auto& k : kDoubleKeys) {
    const double v = this->*k.field;
    // initializer_range may be 0 (constant-zero weights); eps and theta must be positive.
    const bool ok = std::isfinite(v) && (k.field == &LlamaConfig::initializer_range ? v >= 0 : v > 0);
    if (!ok) reject(k.name, v, k.field == &LlamaConfig::initializer_range ? "must be >= 0" : "must be positive");
  }
}

nlohmann::json LlamaConfig::to_json() const {
  json j = json::object();
  for (const auto& k : kIntKeys) j[k.name] = this->*k.field;
  for (const auto& k : kDoubleKeys) j[k.name] = this->*k.field;
  j[kTieKey] = tie_word_embeddings;
  return j;
}

LlamaConfig LlamaConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("LlamaConfig: expected a JSON object, got " + show(j));
  LlamaConfig config;
  bool kv_heads_given = false;
  std::optional<double> nested_rope_theta;
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const auto& k : kIntKeys) {
      if (key != k.name) continue;
      known = true;
      // transformers writes null for "as many key/value heads as attention heads".
      if (key == "num_key_value_heads" && value.is_null()) break;
      config.*k.field = parse_int(key, value);
      kv_heads_given |= key == "num_key_value_heads";
    }
    for (const auto& k : kDoubleKeys) {
      if (key != k.name) continue;
      known = true;
      config.*k.field = parse_double(key, value);
    }
    if (key == kTieKey) {
      known = true;
      if (!value.is_boolean()) reject(key, value, "must be true or false");
      config.tie_word_embeddings = value.get<bool>();
    }
    if (key == "rope_parameters") {
      known = true;
      nested_rope_theta = parse_rope_parameters(value);
    }
    if (!known) reject(key, value, "is not a known key; known keys: " + known_keys());
  }
  if (!kv_heads_given) config.num_key_value_heads = config.num_attention_heads;
  if (nested_rope_theta) {
    if (j.contains("rope_theta") && config.rope_theta != *nested_rope_theta) {
      reject("rope_parameters.rope_theta", *nested_rope_theta, "disagrees with rope_theta=" + show(config.rope_theta));
    }
    config.rope_theta = *nested_rope_theta;
  }
  config.validate();
  return config;
}

void to_json(nlohmann::json& j, const LlamaConfig& config) { j = config.to_json(); }
void from_json(const nlohmann::json& j, LlamaConfig& config) { config = LlamaConfig::from_json(j); }

// ---- building blocks ---------------------------------------------------------------------------

BiasFreeLinearImpl::BiasFreeLinearImpl(int64_t in_features, int64_t out_features, at::Device device)
    : weight(register_parameter("weight", at::empty({out_features, in_features}, at::TensorOptions().device(device)))) {
}

BiasFreeLinearImpl::BiasFreeLinearImpl(at::Tensor shared_weight)
    : weight(register_parameter("weight", std::move(shared_weight))) {}

at::Tensor BiasFreeLinearImpl::forward(const at::Tensor& x) { return at::linear(x, weight); }

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

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(int64_t head_dim, double rope_theta, const at::Tensor& positions,
                                                 at::ScalarType dtype) {
  TORCH_CHECK(positions.dim() == 1, "rotary_cos_sin expects positions [T], got ", positions.sizes());
  // Same operations, in the same order and in fp32, as LlamaRotaryEmbedding: inv_freq =
  // 1 / theta^(2i / d), angles = position * inv_freq, duplicated to [cos(a), cos(a)].
  const auto opts = at::TensorOptions().device(positions.device());
  const auto exponent = at::arange(0, head_dim, 2, opts.dtype(at::kLong)).to(at::kFloat) / head_dim;
  const auto inv_freq = at::reciprocal(at::pow(rope_theta, exponent));
  const auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  const auto angles = at::cat({freqs, freqs}, -1);
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config, at::Device device)
    : num_heads_(config.num_attention_heads), num_kv_heads_(config.num_key_value_heads), head_dim_(config.head_dim()) {
  const int64_t hidden = config.hidden_size;
  q_proj = register_module("q_proj", BiasFreeLinear(hidden, num_heads_ * head_dim_, device));
  k_proj = register_module("k_proj", BiasFreeLinear(hidden, num_kv_heads_ * head_dim_, device));
  v_proj = register_module("v_proj", BiasFreeLinear(hidden, num_kv_heads_ * head_dim_, device));
  o_proj = register_module("o_proj", BiasFreeLinear(num_heads_ * head_dim_, hidden, device));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1);
  auto q = q_proj(x).view({B, T, num_heads_, head_dim_}).transpose(1, 2);  // [B, H, T, D]
  auto k = k_proj(x).view({B, T, num_kv_heads_, head_dim_}).transpose(1, 2);
  auto v = v_proj(x).view({B, T, num_kv_heads_, head_dim_}).transpose(1, 2);
  q = apply_rotary(q, cos, sin);
  k = apply_rotary(k, cos, sin);
  k = repeat_kv(k, num_heads_ / num_kv_heads_);
  v = repeat_kv(v, num_heads_ / num_kv_heads_);

  // Eager attention spelled out rather than at::scaled_dot_product_attention, so the numerics
  // are transformers' eager ones on every backend: scores in the input dtype, softmax in fp32.
  // A masked score of -inf and transformers' additive dtype-min both give exactly 0 after softmax.
  auto scores = at::matmul(q, k.transpose(2, 3)) * (1.0 / std::sqrt(static_cast<double>(head_dim_)));
  const auto future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const auto probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  const auto out = at::matmul(probs, v).transpose(1, 2).reshape({B, T, num_heads_ * head_dim_});
  return o_proj(out);
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
  auto h = embed_tokens(tokens);
  // One rotary table for all layers, in the activations' dtype (as transformers passes
  // position_embeddings down). Under mixed precision fsdp::call casts it with the activations.
  const auto [cos, sin] =
      rotary_cos_sin(config_.head_dim(), config_.rope_theta, at::arange(T, tokens.options()), h.scalar_type());
  for (size_t i = 0; i < layers.size(); ++i) {
    if (checkpoint_every > 0 && static_cast<int64_t>(i) % checkpoint_every == 0 && h.requires_grad()) {
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

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& tokens) { return lm_head(fsdp::call(model, tokens)); }

void LlamaForCausalLMImpl::init_weights() {
  at::NoGradGuard no_grad;
  for (auto& [name, param] : unique_named_parameters(*this)) {
    if (ends_with(name, kNormSuffix)) {
      param.fill_(1.0);
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
  return fsdp::init::by_suffix({{kNormSuffix, fsdp::init::constant(1.0)}},
                               fsdp::init::normal(config.initializer_range, seed));
}

}  // namespace llama
