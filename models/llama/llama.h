// A Llama decoder (Hugging Face transformers' LlamaForCausalLM) in LibTorch, written to be copied.
//
// Parameter names, their order and the config keys match transformers exactly, so a state dict
// moves between the two by name: model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj
// .weight, model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.{input,post_attention}_
// layernorm.weight, model.norm.weight, lm_head.weight. The numerics follow transformers' eager
// path: RMSNorm and softmax in fp32, rotary tables in fp32, each cast back to the input dtype.
//
// Sharding: decoder layers and the inner model are run through fsdp::call, so
//
//   llama::LlamaForCausalLM model(config, at::kMeta);  // allocates nothing
//   auto opts = fsdp::FullyShardOptions().init(llama::llama_init_fn(config, seed));
//   for (auto& layer : model->model->layers) fsdp::fully_shard(layer, mesh, opts);
//   fsdp::fully_shard(model, mesh, opts);
//   auto loss = llama::loss(fsdp::call(model, tokens), targets);
//
// and the same model runs unsharded with no change (fsdp::call is then a plain forward).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "fsdp/options.h"

namespace llama {

// transformers' LlamaConfig: same key names and defaults (the defaults are Llama-2-7B's shape).
// Only the keys this model implements exist; rope scaling, biases and other activations do not.
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  // Grouped-query attention: each key/value head serves num_attention_heads / num_key_value_heads
  // query heads. transformers' null here means num_attention_heads; from_json does the same.
  int64_t num_key_value_heads = 32;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }

  // Throws std::invalid_argument naming the key and value of the first inconsistency.
  void validate() const;
  nlohmann::json to_json() const;
  // Starts from the defaults above; rejects unknown keys, wrong types and invalid values with a
  // std::invalid_argument that names the key and its value. Also reads transformers 5's
  // "rope_parameters": {"rope_type": "default", "rope_theta": x} (other rope types are refused).
  static LlamaConfig from_json(const nlohmann::json& j);
};

// nlohmann's ADL hooks, so `json j = config;` and `j.get<LlamaConfig>()` work too.
void to_json(nlohmann::json& j, const LlamaConfig& config);
void from_json(const nlohmann::json& j, LlamaConfig& config);

// ---- building blocks ---------------------------------------------------------------------------
// Our own leaf modules instead of torch::nn::Linear / Embedding: those allocate and initialise on
// the CPU in their constructors, which defeats construction on the meta device.

// y = x W^T with W: [out_features, in_features], registered as "weight".
class BiasFreeLinearImpl : public torch::nn::Module {
 public:
  BiasFreeLinearImpl(int64_t in_features, int64_t out_features, at::Device device);
  // Registers an existing tensor as "weight" (used to tie lm_head to the embedding).
  explicit BiasFreeLinearImpl(at::Tensor weight);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
};
TORCH_MODULE(BiasFreeLinear);

// Row lookup in "weight": [num_embeddings, embedding_dim].
class TokenEmbeddingImpl : public torch::nn::Module {
 public:
  TokenEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, at::Device device);
  at::Tensor forward(const at::Tensor& tokens);
  at::Tensor weight;
};
TORCH_MODULE(TokenEmbedding);

// LlamaRMSNorm: normalised in fp32, cast back to the input dtype, then scaled by "weight".
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t hidden_size, double eps, at::Device device);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Rotary tables for `positions` (int64 [T]): cos and sin, each [T, head_dim] in `dtype`, computed
// in fp32 like transformers' LlamaRotaryEmbedding (frequencies duplicated, not interleaved).
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(int64_t head_dim, double rope_theta, const at::Tensor& positions,
                                                 at::ScalarType dtype);
// x * cos + rotate_half(x) * sin for x: [..., T, head_dim]; element i pairs with i + head_dim/2.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Causal self-attention with grouped-query heads; scores and softmax as in transformers' eager
// attention (softmax in fp32, probabilities cast back to the input dtype).
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, at::Device device);
  // x: [B, T, hidden]; cos, sin: [T, head_dim] from rotary_cos_sin. Returns [B, T, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  BiasFreeLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
};
TORCH_MODULE(LlamaAttention);

// down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& config, at::Device device);
  at::Tensor forward(const at::Tensor& x);

  BiasFreeLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

// Pre-norm residual block: x += attn(norm(x)); x += mlp(norm(x)). The unit one shards.
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, at::Device device);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// ---- the model ---------------------------------------------------------------------------------

// Token embedding, decoder layers, final norm: tokens [B, T] int64 -> hidden states [B, T, hidden].
class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& config, at::Device device);
  at::Tensor forward(const at::Tensor& tokens);

  TokenEmbedding embed_tokens{nullptr};
  // Typed handles to the layers, for fsdp::call and fully_shard; the same modules are registered
  // in layers_list_ as "layers", which is what gives them the names layers.0, layers.1, ...
  std::vector<LlamaDecoderLayer> layers;
  RMSNorm norm{nullptr};
  // Activation checkpointing (fsdp::checkpoint_activations): 0 off; n > 0 recomputes layers 0, n,
  // 2n, ... in backward instead of keeping their activations (1: every layer).
  int64_t checkpoint_every = 0;

 private:
  LlamaConfig config_;
  torch::nn::ModuleList layers_list_{nullptr};
};
TORCH_MODULE(LlamaModel);

// Note [Tied embeddings]
// With tie_word_embeddings, lm_head.weight IS model.embed_tokens.weight: one tensor registered in
// both modules, so gradients from both uses accumulate into it. LibTorch's named_parameters() and
// parameters() do not deduplicate (unlike PyTorch's), so that tensor is listed under both names;
// give an optimizer unique_parameters() instead, or the tied weight is stepped twice.
class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  // On at::kMeta nothing is allocated; materialise later with llama_init_fn. On a real device the
  // parameters are initialised at once like transformers' _init_weights (see init_weights).
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, at::Device device = at::kCPU);
  // tokens [B, T] int64 -> logits [B, T, vocab_size].
  at::Tensor forward(const at::Tensor& tokens);
  // Norm weights to 1, every other weight from N(0, initializer_range^2), using torch's default
  // generator (torch::manual_seed). For rank-independent values use llama_init_fn instead.
  void init_weights();
  const LlamaConfig& config() const { return config_; }

  LlamaModel model{nullptr};
  BiasFreeLinear lm_head{nullptr};

 private:
  LlamaConfig config_;
};
TORCH_MODULE(LlamaForCausalLM);

// Mean cross-entropy over every token, in fp32: logits [B, T, V], targets [B, T] int64 (a target
// of -100 is ignored, as in transformers).
at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets);

// The parameters of `module`, each tensor once (first name wins). See Note [Tied embeddings].
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module);

// Deferred init matching init_weights: norm weights ("...norm.weight", which also covers
// "...layernorm.weight") set to 1, all others N(0, initializer_range^2) keyed by (seed, name).
fsdp::ParamInitFn llama_init_fn(const LlamaConfig& config, uint64_t seed);

}  // namespace llama
