// See hf.h. Note [Hugging Face config keys]: every key of a family's config.json falls in one of
// four groups, each handled once below: the model's own keys (passed to LlamaConfig::from_json),
// keys renamed or reshaped on the way (rope_scaling, torch_dtype), keys that must hold the one
// value the model implements (hidden_act "silu", no MLP bias, no dropout, no sliding-window layers
// for Qwen; a quantization_config of bitsandbytes 4-bit NF4), and keys that describe no computation
// (dropped). Anything else is refused by name.
#include "hf.h"

#include <cstdio>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace llama::hf {
namespace {

using nlohmann::json;

std::string show(const json& v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

[[noreturn]] void refuse(const std::string& where, const std::string& key, const json& value, const std::string& why) {
  throw std::invalid_argument(where + ": " + key + "=" + show(value) + " " + why);
}

// Keys that are LlamaConfig's own, for every family (family-specific ones are checked by
// LlamaConfig::validate, which knows which family allows what).
const std::set<std::string> kModelKeys = {
    "model_type",          "vocab_size",        "hidden_size",
    "intermediate_size",   "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",          "max_position_embeddings",
    "rms_norm_eps",        "rope_theta",        "rope_parameters",
    "tie_word_embeddings", "initializer_range", "attention_bias",
};
// Keys that describe no computation of the model.
const std::set<std::string> kDropped = {
    "transformers_version", "use_cache",         "bos_token_id",         "eos_token_id", "pad_token_id",
    "_name_or_path",        "output_attentions", "output_hidden_states", "return_dict",  "is_llama_config"};

bool is_zero(const json& v) { return v.is_number() && v.get<double>() == 0.0; }

// Keys that must hold the one value this model implements; true when `key` is one of them.
bool check_fixed(const std::string& where, const std::string& family, const std::string& key, const json& v,
                 const json& doc) {
  const bool qwen = family == "qwen2" || family == "qwen3";
  if (key == "hidden_act") {
    if (v != "silu") refuse(where, key, v, "is not supported: the MLP implements \"silu\" only");
  } else if (key == "mlp_bias") {
    if (v != false) refuse(where, key, v, "is not supported: the MLP has no biases");
  } else if (key == "attention_dropout") {
    if (!is_zero(v)) refuse(where, key, v, "is not supported: attention has no dropout; set it to 0.0");
  } else if (key == "rope_interleaved") {
    if (v != false) refuse(where, key, v, "is not supported: rotary pairs are the halves, not interleaved");
  } else if (key == "pretraining_tp" && family == "llama") {
    if (!v.is_null() && v != 1) refuse(where, key, v, "is not supported: only 1 (no tensor-parallel slicing)");
  } else if (key == "use_sliding_window" && qwen) {
    if (v != false) {
      refuse(where, key, v, "is not supported: sliding-window layers are implemented for mistral only");
    }
  } else if (key == "use_mrope" && qwen) {
    // Qwen2.5's configs carry it (false); multimodal rotary sections are Qwen2-VL's.
    if (v != false) refuse(where, key, v, "is not supported: multimodal rotary embedding (mrope) is not implemented");
  } else if ((key == "sliding_window" || key == "max_window_layers") && qwen) {
    // Without use_sliding_window (refused above when set), transformers ignores both.
    (void)doc;
  } else if (key == "layer_types" && qwen) {
    if (!v.is_array()) refuse(where, key, v, "must be a list of layer types");
    for (const auto& t : v) {
      if (t != "full_attention") {
        refuse(where, key, v, "is not supported: every layer must be \"full_attention\"");
      }
    }
  } else {
    return false;
  }
  return true;
}

// rope_scaling (transformers 4's name for rope_parameters, with "type" or "rope_type").
json rope_from_scaling(const std::string& where, const json& v) {
  if (!v.is_object()) refuse(where, "rope_scaling", v, "must be an object or null");
  json out = json::object();
  for (const auto& [k, x] : v.items()) out[k == "type" ? "rope_type" : k] = x;
  return out;
}

void check_architectures(const std::string& where, const std::string& family, const json& v) {
  const std::string want = architecture(family);
  if (!v.is_array()) refuse(where, "architectures", v, "must be a list");
  for (const auto& a : v) {
    if (a != want)
      refuse(where, "architectures", v, "is not supported: only " + want + " is, for model_type " + family);
  }
}

// quantization_config: a bitsandbytes 4-bit NF4 save, whose weights the import reads as they are
// (Note [bitsandbytes 4-bit weights] in src/bnb/bnb4.cpp); any other quantization is refused by name.
void check_quantization(const std::string& where, const json& v) {
  const std::string key = "quantization_config.";
  const json method = v.is_object() ? v.value("quant_method", json()) : v;
  const std::string only = "only bitsandbytes 4-bit NF4 weights (load_in_4bit, bnb_4bit_quant_type \"nf4\") import";
  if (method != "bitsandbytes") refuse(where, key + "quant_method", method, "is not supported: " + only);
  if (v.value("load_in_8bit", false)) refuse(where, key + "load_in_8bit", true, "is not supported: " + only);
  if (!v.value("load_in_4bit", false)) refuse(where, key + "load_in_4bit", v.value("load_in_4bit", json()), only);
  const json type = v.value("bnb_4bit_quant_type", json("fp4"));  // bitsandbytes' default
  if (type != "nf4") refuse(where, key + "bnb_4bit_quant_type", type, "is not supported: " + only);
}

// The LlamaConfig JSON of a config.json: see Note [Hugging Face config keys].
json model_json(const std::string& where, const std::string& family, const json& doc) {
  json out = json::object();
  for (const auto& [key, v] : doc.items()) {
    if (kModelKeys.count(key)) {
      out[key] = v;
    } else if (family == "mistral" && key == "sliding_window") {
      out[key] = v;
    } else if (key == "rope_scaling") {
      if (!v.is_null()) out["rope_scaling"] = rope_from_scaling(where, v);
    } else if (key == "dtype" || key == "torch_dtype") {
      if (v.is_null()) continue;
      if (v != "bfloat16" && v != "float16" && v != "float32") {
        refuse(where, key, v, "is not supported: the weights must be bfloat16, float16 or float32");
      }
      out["dtype"] = v;
    } else if (key == "architectures") {
      check_architectures(where, family, v);
    } else if (key == "quantization_config") {
      check_quantization(where, v);
    } else if (!kDropped.count(key) && !check_fixed(where, family, key, v, doc)) {
      refuse(where, key, v,
             "is not an option this importer knows for model_type " + family +
                 "; refusing it rather than ignoring it (an architecture option the model does not implement?)");
    }
  }
  if (out.contains("rope_scaling")) {
    json rope = out["rope_scaling"];
    out.erase("rope_scaling");
    if (out.contains("rope_parameters") && out["rope_parameters"] != rope) {
      if (!out["rope_parameters"].is_object())
        refuse(where, "rope_parameters", out["rope_parameters"], "must be an object");
      for (const auto& [k, x] : rope.items()) {
        if (out["rope_parameters"].contains(k) && out["rope_parameters"][k] != x) {
          refuse(where, "rope_scaling." + k, x, "disagrees with rope_parameters." + k);
        }
        out["rope_parameters"][k] = x;
      }
    } else {
      out["rope_parameters"] = rope;
    }
  }
  return out;
}

// The family a document names (model_type), or `fallback` when it names none.
std::string family_of(const std::string& where, const json& doc, const std::string& fallback) {
  if (!doc.contains("model_type")) return fallback;
  const json& type = doc["model_type"];
  for (const auto& t : model_types()) {
    if (type == t) return t;
  }
  refuse(where, "model_type", type, "is not supported; supported model types: llama, qwen2, qwen3, mistral");
}

}  // namespace

json model_keys(const json& doc, const std::string& where, const std::string& default_type) {
  if (!doc.is_object()) throw std::invalid_argument(where + ": expected a JSON object, got " + show(doc));
  const std::string family = family_of(where, doc, default_type);
  json rest = doc, own = json::object();
  // LlamaConfig's keys that no config.json spells: kept as they are.
  for (const char* key : {"attn_implementation", "sliding_window"}) {
    const bool qwen = family == "qwen2" || family == "qwen3";  // Qwen's sliding_window: see check_fixed
    if (rest.contains(key) && !(qwen && std::string(key) == "sliding_window")) {
      own[key] = rest[key];
      rest.erase(key);
    }
  }
  json out = model_json(where, family, rest);
  out.update(own);
  return out;
}

std::string architecture(const std::string& model_type) {
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "mistral") return "MistralForCausalLM";
  throw std::invalid_argument("model_type \"" + model_type + "\" is not supported");
}

LlamaConfig config_from_hf_json(const std::string& text, const std::string& where) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    throw std::invalid_argument(where + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object()) throw std::invalid_argument(where + ": expected a JSON object, got " + show(doc));
  if (!doc.contains("model_type")) {
    throw std::invalid_argument(where + ": has no model_type; supported: llama, qwen2, qwen3, mistral");
  }
  const std::string family = family_of(where, doc, "");
  // transformers fills these from its class defaults (a 4096-wide, 32-layer model) when a file leaves
  // them out; a plan or an import of that guess would describe some other model, so each is required.
  for (const char* key :
       {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}) {
    if (!doc.contains(key) || doc[key].is_null()) {
      throw std::invalid_argument(where + ": has no " + key +
                                  "; a model's config.json gives vocab_size, hidden_size, "
                                  "intermediate_size, num_hidden_layers and num_attention_heads");
    }
  }
  const json model = model_json(where, family, doc);
  try {
    return LlamaConfig::from_json(model);
  } catch (const std::invalid_argument& e) {
    std::string msg = e.what();
    const std::string prefix = "LlamaConfig: ";
    if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
    throw std::invalid_argument(where + ": " + msg);
  }
}

LlamaConfig read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw std::invalid_argument(dir + " is not a Hugging Face model directory: it has no config.json (" + path +
                                " cannot be opened)");
  }
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0 && text.size() < (64u << 20)) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw std::invalid_argument(path + ": cannot be read");
  return config_from_hf_json(text, path);
}

json hf_config_json(const LlamaConfig& c, const std::string& dtype) {
  json j = c.to_json();
  j.erase("attn_implementation");
  j.erase("rope_parameters");
  j["architectures"] = {architecture(c.model_type)};
  j["dtype"] = dtype;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["head_dim"] = c.head_dim();
  json rope = {{"rope_type", c.rope_scaling.rope_type}, {"rope_theta", c.rope_theta}};
  if (c.rope_scaling.rope_type == "llama3") rope.update(c.to_json()["rope_parameters"]);
  j["rope_parameters"] = rope;
  if (c.model_type == "llama") {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  if (c.model_type == "qwen2" || c.model_type == "mistral") j.erase("attention_bias");
  if (c.model_type == "qwen2" || c.model_type == "qwen3") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_hidden_layers;
    j["layer_types"] = std::vector<std::string>(static_cast<size_t>(c.num_hidden_layers), "full_attention");
  }
  if (c.model_type == "mistral") {
    j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  } else if (c.model_type == "llama") {
    j.erase("sliding_window");
  }
  j["use_cache"] = true;
  // The trainer has no special tokens; transformers' defaults (1 and 2 for some families) would
  // claim otherwise.
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  j["pad_token_id"] = nullptr;
  return j;
}

}  // namespace llama::hf
