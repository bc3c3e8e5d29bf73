// A Llama decoder (Hugging Face transformers' LlamaForCausalLM) in LibTorch, written to be copied,
// with the variations of its Qwen2, Qwen3 and Mistral relatives (LlamaConfig::model_type).
//
// Parameter names, their order and the config keys match transformers exactly, so a state dict
// moves between the two by name: model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj
// .weight (and .bias: qwen2, attention_bias), model.layers.N.self_attn.{q,k}_norm.weight (qwen3),
// model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.{input,post_attention}_
// layernorm.weight, model.norm.weight, lm_head.weight. The numerics follow transformers': RMSNorm
// and rotary tables in fp32, each cast back to the input dtype; attention through
// at::scaled_dot_product_attention as transformers' "sdpa", or its eager path spelled out.
//
// Sharding: decoder layers and the inner model are run through fsdp::call, so
//
//   llama::LlamaForCausalLM model(config, at::kMeta);  // allocates nothing
//   auto opts = fsdp::FullyShardOptions().init(llama::llama_init_fn(config, seed));
//   for (auto& layer : model->model->layers) fsdp::fully_shard(layer, mesh, opts);
//   fsdp::fully_shard(model, mesh, opts);
//   auto loss = llama::loss(fsdp::call(model, tokens), targets);
//
// and the same model runs unsharded with no change (fsdp::call is then a plain forward). The
// embedding and the head are run through fsdp::call too, so that a model whose head is not tied to
// its embedding may shard them as units of their own (shard_embedding_and_head), out of the root.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "fsdp/device_mesh.h"
#include "fsdp/options.h"

namespace llama {

// The rotary embedding's frequencies: transformers' rope_parameters (rope_scaling before
// transformers 5) without rope_theta, which is LlamaConfig::rope_theta.
struct RopeScaling {
  std::string rope_type = "default";  // "default" (unscaled) or "llama3" (Llama 3.1's scaling)
  // "llama3" only: wavelengths above original_max_position_embeddings / low_freq_factor are
  // divided by `factor`, those below ... / high_freq_factor kept, the ones between interpolated.
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// transformers' LlamaConfig and the decoder families that share its shape: same key names and
// defaults (the defaults are Llama-2-7B's shape). model_type picks the family, each a variation
// of the same block (docs/NOTES.md, "Model families"):
//   "llama"    attention_bias (q, k, v, o biases), rope_type "llama3"
//   "qwen2"    q, k and v projections with biases (always), o without
//   "qwen3"    q_norm and k_norm: RMSNorm over head_dim of each query and key head, before rotary
//   "mistral"  sliding_window: a token attends to itself and the sliding_window - 1 before it
// Only the keys this model implements exist; models/llama/hf.h reads a Hugging Face config.json
// and refuses by name what is not implemented.
struct LlamaConfig {
  std::string model_type = "llama";
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  // Grouped-query attention: each key/value head serves num_attention_heads / num_key_value_heads
  // query heads. transformers' null here means num_attention_heads; from_json does the same.
  int64_t num_key_value_heads = 32;
  int64_t max_position_embeddings = 2048;
  // JSON "head_dim": the size of each attention head; 0 (or null) means hidden_size /
  // num_attention_heads. Qwen3 sets it independently of hidden_size.
  int64_t head_dim_override = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;  // JSON: "rope_parameters" (with rope_theta) when not "default"
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // "llama", "qwen3": biases on q, k, v and o
  int64_t sliding_window = 0;   // "mistral": 0 or null means full causal attention
  double initializer_range = 0.02;
  // "sdpa" (at::scaled_dot_product_attention, transformers' default) or "eager" (scores and
  // softmax spelled out as transformers' eager path). Not part of a Hugging Face config.json.
  std::string attn_implementation = "sdpa";
  // The dtype of the published weights ("bfloat16", "float16" or "float32", transformers' "dtype");
  // training keeps fp32 masters whatever it is. fsdp-ckpt export writes this dtype by default.
  std::string dtype = "float32";

  int64_t head_dim() const { return head_dim_override > 0 ? head_dim_override : hidden_size / num_attention_heads; }
  bool qkv_bias() const { return attention_bias || model_type == "qwen2"; }
  bool o_bias() const { return attention_bias; }
  bool qk_norm() const { return model_type == "qwen3"; }

  // Throws std::invalid_argument naming the key and value of the first inconsistency.
  void validate() const;
  nlohmann::json to_json() const;
  // What identifies the model (fsdp-train's config_hash): to_json without attn_implementation (a
  // runtime choice), and without the keys added since the first release (model_type, head_dim,
  // sliding_window, attention_bias, dtype) while they hold their defaults, so that a plain Llama's
  // identity, and the hashes of checkpoints saved before those keys existed, stay as they were.
  nlohmann::json identity_json() const;
  // Starts from the defaults above; rejects unknown keys, wrong types and invalid values with a
  // std::invalid_argument that names the key and its value. rope_theta may also come nested, as
  // transformers 5 writes it: "rope_parameters": {"rope_type": ..., "rope_theta": x, ...}.
  static LlamaConfig from_json(const nlohmann::json& j);
};

// The families model_type may name, in the order above.
const std::vector<std::string>& model_types();

// Parameters of one decoder layer and of the rest (embedding, final norm, lm_head unless tied).
struct ParamCounts {
  int64_t per_layer = 0;
  int64_t root = 0;
  int64_t total(const LlamaConfig& c) const { return root + c.num_hidden_layers * per_layer; }
};
ParamCounts param_counts(const LlamaConfig& config);

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
  // x @ weight^T; with chunk_tokens > 0, the chunked loss of x against `targets` over this head
  // instead (fsdp::chunked_cross_entropy): one forward, so that a head sharded as a unit of its own
  // is gathered around it.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& targets = {}, int64_t chunk_tokens = 0);
  at::Tensor weight;
};
TORCH_MODULE(BiasFreeLinear);

// y = x W^T + b, with "weight" [out_features, in_features] and, when `bias`, "bias" [out_features].
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias, at::Device device);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;  // bias undefined without one
};
TORCH_MODULE(Linear);

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
// in fp32 like transformers' LlamaRotaryEmbedding (frequencies duplicated, not interleaved), with
// the frequencies of `scaling` (rope_type "default" or "llama3").
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(int64_t head_dim, double rope_theta, const at::Tensor& positions,
                                                 at::ScalarType dtype, const RopeScaling& scaling = {});
// The inverse frequencies [head_dim / 2] (fp32) rotary_cos_sin uses.
at::Tensor rotary_inv_freq(int64_t head_dim, double rope_theta, const RopeScaling& scaling, const at::Device& device);
// x * cos + rotate_half(x) * sin for x: [..., T, head_dim]; element i pairs with i + head_dim/2.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Causal self-attention with grouped-query heads, the family's biases, q/k norms and sliding
// window. attn_implementation "sdpa" runs at::scaled_dot_product_attention; "eager" spells out
// transformers' eager attention (softmax in fp32, probabilities cast back to the input dtype).
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& config, at::Device device);
  // x: [B, T, hidden]; cos, sin: [T, head_dim] from rotary_cos_sin. Returns [B, T, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // "qwen3" only

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, sliding_window_;
  bool sdpa_;
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
  // The embedding is a vocab-parallel table (shard_vocab_parallel): looked up by
  // fsdp::sharded_embedding instead of run through fsdp::call.
  bool vocab_parallel = false;

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
  // tokens and targets [B, T] int64 -> the mean loss (llama::loss), without the logits when
  // loss_chunk_tokens > 0: the head and the cross-entropy then run that many tokens at a time
  // (fsdp::chunked_cross_entropy, fsdp/loss.h), so the [B * T, vocab] logits never exist whole.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& targets);
  void set_loss_chunk_tokens(int64_t tokens);
  int64_t loss_chunk_tokens() const { return loss_chunk_tokens_; }
  // The embedding and the head are vocab-parallel tables (shard_vocab_parallel): the loss is
  // fsdp::sharded_cross_entropy over the head's rows where they are, and forward(tokens), which
  // would need every logit on every rank, is refused.
  bool vocab_parallel() const { return model->vocab_parallel; }
  // Norm weights to 1, biases to 0, every other weight from N(0, initializer_range^2), using torch's default
  // generator (torch::manual_seed). For rank-independent values use llama_init_fn instead.
  void init_weights();
  const LlamaConfig& config() const { return config_; }

  LlamaModel model{nullptr};
  BiasFreeLinear lm_head{nullptr};

 private:
  LlamaConfig config_;
  int64_t loss_chunk_tokens_ = 0;  // 0: whole logits
};
TORCH_MODULE(LlamaForCausalLM);

// Shards the embedding and the head as units of their own (fsdp::fully_shard on
// model.embed_tokens and lm_head), before the root is sharded: the root then holds the final norm
// only. Each is gathered around its own forward (and backward), not for the whole step as the
// root's parameters are: a frozen embedding never in backward, the head, the last unit to run,
// from its forward through its backward. Refused (ConfigError) when tie_word_embeddings makes
// them one tensor.
void shard_embedding_and_head(LlamaForCausalLM& model, fsdp::DeviceMesh& mesh, const fsdp::FullyShardOptions& options);
// Whether shard_embedding_and_head accepts this config (the head is not tied to the embedding).
inline bool can_shard_embedding_and_head(const LlamaConfig& config) { return !config.tie_word_embeddings; }

// Shards the embedding and the head (one tensor when tied) as vocab-parallel tables
// (FullyShardOptions::vocab_parallel, fsdp/vocab_parallel.h), before the root is sharded: never
// gathered, each rank looking up and computing the logits of the rows its shard holds. Both must
// be frozen (a LoRA base) and the head a plain weight; can_shard_vocab_parallel says whether they
// are. Refused (ConfigError) otherwise.
void shard_vocab_parallel(LlamaForCausalLM& model, fsdp::DeviceMesh& mesh, fsdp::FullyShardOptions options);
bool can_shard_vocab_parallel(const LlamaForCausalLM& model);

// Mean cross-entropy over every token, in fp32: logits [B, T, V], targets [B, T] int64 (a target
// of -100 is ignored, as in transformers).
at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets);

// The parameters of `module`, each tensor once (first name wins). See Note [Tied embeddings].
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module);

// Deferred init matching init_weights: norm weights ("...norm.weight", which also covers
// "...layernorm.weight", q_norm and k_norm) set to 1, biases to 0, all others
// N(0, initializer_range^2) keyed by (seed, name).
fsdp::ParamInitFn llama_init_fn(const LlamaConfig& config, uint64_t seed);

}  // namespace llama
