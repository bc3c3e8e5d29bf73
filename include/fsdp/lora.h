// LoRA: low-rank adapters on the Linear layers of any module, added before sharding.
//
// fsdp::lora(model, options) freezes every parameter of `model` and gives each Linear whose name
// matches a target pattern two trainable child modules, "lora_A" (weight [r, in]) and "lora_B"
// (weight [out, r]), so that its output becomes
//
//     base(x) + lora_B(lora_A(dropout(x))) * (alpha / r)
//
// as in PEFT, with PEFT's parameter names (e.g. "layers.0.self_attn.q_proj.lora_A.weight") and its
// initialisation (A uniform in +-1/sqrt(in), B zero). The user's module code does not change: the
// Linear's forward reads its `weight` member, which lora() replaces with a tensor that routes the
// Linear's matrix product through the adapters (Note [How an adapter joins a Linear's forward] in
// src/lora/lora.cpp). The registered parameter "weight" is untouched, so fully_shard, checkpoints
// and imports see the base weight under its usual name.
//
// A Linear here is torch::nn::Linear, or a module type declared with register_linear_type (a model
// with its own Linear modules, such as models/llama's, declares them once).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp/options.h"

namespace fsdp {

struct LoraOptions {
  // Module name patterns. A plain pattern matches a module whose name is the pattern or ends with
  // "." + pattern ("q_proj", "self_attn.q_proj"); a pattern with regular-expression characters
  // other than '.' ("layers\\.[0-3]\\..*_proj") must match the whole name. Each must match at least
  // one module, and every module matched must be a Linear.
  TORCH_ARG(std::vector<std::string>, targets) = std::vector<std::string>{"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"};
  TORCH_ARG(int64_t, r) = 8;
  TORCH_ARG(double, alpha) = 16.0;
  TORCH_ARG(double, dropout) = 0.0;  // on the adapters' input, in training mode only
  // How the frozen base is stored once sharded: its targets' weights in this storage, the other
  // frozen parameters (norms, embeddings, biases) in it too when it is a floating dtype, else in
  // the compute dtype. kParamDtype: every frozen parameter in the compute dtype.
  TORCH_ARG(FrozenStorage, base_dtype) = FrozenStorage::kParamDtype;
};

// One adapted Linear.
struct LoraTarget {
  std::string name;  // the Linear's module name, e.g. "layers.0.self_attn.q_proj"
  int64_t in_features = 0, out_features = 0;
  at::Tensor base_weight;  // the Linear's registered "weight" (identity kept through sharding)
};

// What lora() did: its targets, in module order.
struct LoraModel {
  LoraOptions options;
  std::vector<LoraTarget> targets;
  double scaling() const { return options.alpha() / static_cast<double>(options.r()); }
  // The adapters' deferred init (A uniform, B zero, from `seed`) ahead of `base` for every other
  // parameter: the init to give fully_shard for a model built on the meta device.
  ParamInitFn init(ParamInitFn base, uint64_t seed) const;
  // FullyShardOptions::frozen_storage for options.base_dtype (see above).
  FrozenStorageFn frozen_storage() const;
  // The names of the adapters' parameters, relative to the model ("...q_proj.lora_A.weight").
  std::vector<std::string> adapter_names() const;
};

// Adds adapters to `model` (see above). Throws ConfigError for a pattern that matches nothing, a
// matched module that is not a Linear, r < 1, alpha <= 0, dropout outside [0, 1), a model that
// already has adapters, or a model that is already sharded. Adapters are created on the base
// weight's device (the meta device included) in its dtype; without deferred init they are
// initialised at once from `seed`.
LoraModel lora(torch::nn::Module& model, const LoraOptions& options, uint64_t seed = 0);

// Whether `model` has adapters from lora().
bool has_lora(torch::nn::Module& model);

// The adapter-name rule, in one place. lora() names the weights of the adapters it gives a Linear
// "<module>.lora_A.weight" and "<module>.lora_B.weight", as PEFT does, with any prefix before.
enum class LoraWeight { kA, kB };
std::string lora_adapter_name(const std::string& module, LoraWeight which);
// Whether `name` (a parameter's or a stored tensor's) is an adapter's weight.
bool is_lora_adapter(const std::string& name);
// The adapted module of an adapter's weight ("layers.0.q_proj" of "layers.0.q_proj.lora_A.weight"),
// or "" when `name` is no adapter's weight; `which`, when given, receives A or B.
std::string lora_module_of(const std::string& name, LoraWeight* which = nullptr);

// Folds each adapter into its base weight (W += B A * alpha / r) and removes the adapters, leaving
// plain Linears. For an unsharded model (fully_shard's units hold flat buffers that cannot lose
// parameters): merge a sharded model's checkpoint offline (fsdp-ckpt export --merged).
void merge_lora(torch::nn::Module& model);

// Declares module type T a Linear for lora(): `weight(m)` returns the member its forward passes
// to at::linear (or F::linear) as the weight. torch::nn::LinearImpl is declared already.
void register_linear_type(const std::type_info& type, std::function<at::Tensor*(torch::nn::Module&)> weight);
template <typename T, typename Fn>
void register_linear_type(Fn weight) {
  register_linear_type(typeid(T), [weight](torch::nn::Module& m) { return weight(static_cast<T&>(m)); });
}

}  // namespace fsdp
