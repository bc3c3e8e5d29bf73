// Hugging Face model directories for the decoder families of llama.h: config.json in and out.
//
// Parsing takes the file's text (no file system), so a fuzzer can drive it: config_from_hf_json
// turns a transformers config.json of model_type llama, qwen2, qwen3 or mistral into a
// LlamaConfig, refusing by name every architecture option the model does not implement (a rope
// type other than default and llama3, biases on the MLP, an activation other than silu, attention
// dropout, Qwen's sliding-window layers, ...) and every key it does not know, rather than
// ignoring it. Keys that describe no computation (token ids, use_cache, transformers_version,
// architectures naming the family's ...ForCausalLM) are accepted and dropped.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "llama.h"

namespace llama::hf {

// `text` is the content of a config.json; `where` names it in messages (e.g. "DIR/config.json").
// Throws std::invalid_argument "WHERE: key=value why" naming the first offending key.
LlamaConfig config_from_hf_json(const std::string& text, const std::string& where);

// The LlamaConfig keys of a model description in config.json's terms (fsdp-train's model section):
// LlamaConfig's own keys as they are, the rest by config_from_hf_json's rules (reshaped, checked
// against the one value the model implements, dropped, or refused by name). `default_type`: the
// family when `doc` has no model_type. Required sizes are not checked: the caller lays `doc` over
// its defaults. Throws std::invalid_argument "WHERE: key=value why".
nlohmann::json model_keys(const nlohmann::json& doc, const std::string& where, const std::string& default_type);

// Reads DIR/config.json (config_from_hf_json). Throws std::invalid_argument naming the directory
// when it has no config.json or cannot be read.
LlamaConfig read_hf_config(const std::string& dir);

// The config.json transformers needs to load `config` as its own family (architectures,
// model_type, every option spelled out, "dtype" = `dtype`). config_from_hf_json gives `config`
// back, attn_implementation and dtype apart.
nlohmann::json hf_config_json(const LlamaConfig& config, const std::string& dtype);

// "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM" or "MistralForCausalLM".
std::string architecture(const std::string& model_type);

}  // namespace llama::hf
