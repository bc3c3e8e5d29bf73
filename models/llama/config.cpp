// LlamaConfig (llama.h): its JSON form, parsing and validation, and the parameter counts.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "llama.h"

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
  int64_t min;  // smallest valid value
  int64_t max;  // largest: far beyond any published model, so that sizes stay in 64-bit arithmetic
};
struct DoubleKey {
  const char* name;
  double LlamaConfig::*field;
};
struct BoolKey {
  const char* name;
  bool LlamaConfig::*field;
};
struct StringKey {
  const char* name;
  std::string LlamaConfig::*field;
  const char* allowed;  // comma-separated (model_type: see model_types())
};
constexpr IntKey kIntKeys[] = {
    {"vocab_size", &LlamaConfig::vocab_size, 1, int64_t{1} << 28},
    {"hidden_size", &LlamaConfig::hidden_size, 1, int64_t{1} << 20},
    {"intermediate_size", &LlamaConfig::intermediate_size, 1, int64_t{1} << 22},
    {"num_hidden_layers", &LlamaConfig::num_hidden_layers, 1, int64_t{1} << 16},
    {"num_attention_heads", &LlamaConfig::num_attention_heads, 1, int64_t{1} << 16},
    {"num_key_value_heads", &LlamaConfig::num_key_value_heads, 1, int64_t{1} << 16},
    {"max_position_embeddings", &LlamaConfig::max_position_embeddings, 1, int64_t{1} << 32},
    {"head_dim", &LlamaConfig::head_dim_override, 0, int64_t{1} << 16},
    {"sliding_window", &LlamaConfig::sliding_window, 0, int64_t{1} << 32},
};
// The most parameters a config may describe (a million billion, about a thousand times the largest
// published model): its bytes, optimizer state included, stay far inside 64-bit arithmetic.
constexpr double kMaxParams = 1e15;
constexpr DoubleKey kDoubleKeys[] = {
    {"rms_norm_eps", &LlamaConfig::rms_norm_eps},
    {"rope_theta", &LlamaConfig::rope_theta},
    {"initializer_range", &LlamaConfig::initializer_range},
};
constexpr BoolKey kBoolKeys[] = {
    {"tie_word_embeddings", &LlamaConfig::tie_word_embeddings},
    {"attention_bias", &LlamaConfig::attention_bias},
};
constexpr StringKey kStringKeys[] = {
    {"model_type", &LlamaConfig::model_type, "llama, qwen2, qwen3, mistral"},
    {"attn_implementation", &LlamaConfig::attn_implementation, "sdpa, eager"},
    {"dtype", &LlamaConfig::dtype, "bfloat16, float16, float32"},
};
constexpr const char* kRopeKey = "rope_parameters";

std::string known_keys() {
  std::string keys;
  for (const auto& k : kStringKeys) keys += std::string(k.name) + ", ";
  for (const auto& k : kIntKeys) keys += std::string(k.name) + ", ";
  for (const auto& k : kDoubleKeys) keys += std::string(k.name) + ", ";
  for (const auto& k : kBoolKeys) keys += std::string(k.name) + ", ";
  return keys + kRopeKey;
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

bool listed(const std::string& value, const std::string& allowed) {
  return (", " + allowed + ",").find(", " + value + ",") != std::string::npos;
}

// rope_parameters: {"rope_type": "default" | "llama3", "rope_theta": x, and for "llama3" factor,
// low_freq_factor, high_freq_factor, original_max_position_embeddings}. Every other rope type and
// key is refused by name rather than silently ignored. Returns the nested rope_theta, if any.
std::optional<double> parse_rope_parameters(const json& value, RopeScaling& out) {
  if (!value.is_object()) reject(kRopeKey, value, "must be an object");
  // rope_type first: for an unsupported scaling it is the informative rejection.
  const json type = value.contains("rope_type") ? value["rope_type"] : json("default");
  if (type != "default" && type != "llama3") {
    reject("rope_parameters.rope_type", type,
           "is not supported: only \"default\" and \"llama3\" rotary embeddings are");
  }
  out = RopeScaling{};
  out.rope_type = type.get<std::string>();
  const bool llama3 = out.rope_type == "llama3";
  std::optional<double> theta;
  int llama3_keys = 0;
  for (const auto& [key, v] : value.items()) {
    const std::string name = "rope_parameters." + key;
    if (key == "rope_type") continue;
    if (key == "rope_theta") {
      theta = parse_double(name, v);
    } else if (llama3 && key == "factor") {
      out.factor = parse_double(name, v), ++llama3_keys;
    } else if (llama3 && key == "low_freq_factor") {
      out.low_freq_factor = parse_double(name, v), ++llama3_keys;
    } else if (llama3 && key == "high_freq_factor") {
      out.high_freq_factor = parse_double(name, v), ++llama3_keys;
    } else if (llama3 && key == "original_max_position_embeddings") {
      out.original_max_position_embeddings = parse_int(name, v), ++llama3_keys;
    } else {
      reject(name, v,
             "is not supported for rope_type \"" + out.rope_type + "\"" +
                 (llama3 ? ": the keys are rope_theta, factor, low_freq_factor, high_freq_factor and "
                           "original_max_position_embeddings"
                         : ": the only key is rope_theta"));
    }
  }
  if (llama3 && llama3_keys != 4) {
    reject(kRopeKey, value,
           "with rope_type \"llama3\" needs factor, low_freq_factor, high_freq_factor and "
           "original_max_position_embeddings");
  }
  return theta;
}

void validate_family(const LlamaConfig& c) {
  const std::string family = "for model_type \"" + c.model_type + "\"";
  if (c.attention_bias && (c.model_type == "qwen2" || c.model_type == "mistral")) {
    reject("attention_bias", true,
           "is not an option " + family + " (qwen2 always has q/k/v biases and no o bias; mistral none)");
  }
  if (c.sliding_window != 0 && c.model_type != "mistral") {
    reject("sliding_window", c.sliding_window, "is not supported " + family + ": only mistral's is implemented");
  }
  if (c.rope_scaling.rope_type == "llama3") {
    const auto& r = c.rope_scaling;
    if (!(r.factor > 0) || !(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor) ||
        !std::isfinite(r.factor) || !std::isfinite(r.high_freq_factor) || r.original_max_position_embeddings <= 0) {
      reject(kRopeKey, c.to_json()[kRopeKey],
             "is invalid: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
             "original_max_position_embeddings > 0");
    }
  }
}

}  // namespace

const std::vector<std::string>& model_types() {
  static const std::vector<std::string> types = {"llama", "qwen2", "qwen3", "mistral"};
  return types;
}

void LlamaConfig::validate() const {
  for (const auto& k : kStringKeys) {
    if (!listed(this->*k.field, k.allowed)) reject(k.name, this->*k.field, std::string("must be one of ") + k.allowed);
  }
  for (const auto& k : kIntKeys) {
    if (this->*k.field < k.min) reject(k.name, this->*k.field, k.min == 0 ? "must be >= 0" : "must be positive");
    if (this->*k.field > k.max) reject(k.name, this->*k.field, "is out of range: at most " + std::to_string(k.max));
  }
  {  // in floating point: the product of the maxima above does not fit 64 bits
    const double H = static_cast<double>(hidden_size), I = static_cast<double>(intermediate_size);
    const double heads = static_cast<double>(num_attention_heads + 2 * num_key_value_heads);
    const double d = static_cast<double>(head_dim_override > 0 ? head_dim_override : hidden_size / num_attention_heads);
    const double per_layer = H * heads * d + heads * d * H + 3 * H * I;
    const double total = static_cast<double>(num_hidden_layers) * per_layer + 2 * static_cast<double>(vocab_size) * H;
    if (total > kMaxParams) {
      reject("num_hidden_layers", num_hidden_layers,
             "with hidden_size=" + std::to_string(hidden_size) + ", intermediate_size=" +
                 std::to_string(intermediate_size) + " and vocab_size=" + std::to_string(vocab_size) +
                 " describes about " + show(total) + " parameters, more than the 1e15 this model supports");
    }
  }
  if (head_dim_override == 0 && hidden_size % num_attention_heads != 0) {
    reject("hidden_size", hidden_size,
           "is not divisible by num_attention_heads=" + std::to_string(num_attention_heads));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    reject("num_attention_heads", num_attention_heads,
           "is not divisible by num_key_value_heads=" + std::to_string(num_key_value_heads));
  }
  if (head_dim() % 2 != 0) {
    reject(head_dim_override > 0 ? "head_dim" : "hidden_size", head_dim_override > 0 ? head_dim_override : hidden_size,
           "gives head_dim=" + std::to_string(head_dim()) + ", which must be even for rotary embeddings");
  }
  for (const auto& k : kDoubleKeys) {
    const double v = this->*k.field;
    // initializer_range may be 0 (constant-zero weights); eps and theta must be positive.
    const bool ok = std::isfinite(v) && (k.field == &LlamaConfig::initializer_range ? v >= 0 : v > 0);
    if (!ok) reject(k.name, v, k.field == &LlamaConfig::initializer_range ? "must be >= 0" : "must be positive");
  }
  validate_family(*this);
}

nlohmann::json LlamaConfig::to_json() const {
  json j = json::object();
  for (const auto& k : kStringKeys) j[k.name] = this->*k.field;
  for (const auto& k : kIntKeys) j[k.name] = this->*k.field;
  for (const auto& k : kDoubleKeys) j[k.name] = this->*k.field;
  for (const auto& k : kBoolKeys) j[k.name] = this->*k.field;
  if (rope_scaling.rope_type != "default") {
    j[kRopeKey] = {{"rope_type", rope_scaling.rope_type},
                   {"rope_theta", rope_theta},
                   {"factor", rope_scaling.factor},
                   {"low_freq_factor", rope_scaling.low_freq_factor},
                   {"high_freq_factor", rope_scaling.high_freq_factor},
                   {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  }
  return j;
}

nlohmann::json LlamaConfig::identity_json() const {
  json j = to_json();
  j.erase("attn_implementation");
  const json defaults = LlamaConfig{}.to_json();
  for (const char* key : {"model_type", "head_dim", "sliding_window", "attention_bias", "dtype"}) {
    if (j[key] == defaults[key]) j.erase(key);
  }
  return j;
}

namespace {

// Sets `key` of `config` from `value`; false when `key` is not one of the scalar keys.
bool parse_scalar_key(const std::string& key, const json& value, LlamaConfig& config) {
  for (const auto& k : kIntKeys) {
    if (key != k.name) continue;
    // transformers writes null for "the default": as many key/value heads as attention heads,
    // head_dim from hidden_size, no sliding window.
    if (!value.is_null()) config.*k.field = parse_int(key, value);
    return true;
  }
  for (const auto& k : kDoubleKeys) {
    if (key != k.name) continue;
    config.*k.field = parse_double(key, value);
    return true;
  }
  for (const auto& k : kBoolKeys) {
    if (key != k.name) continue;
    if (!value.is_boolean()) reject(key, value, "must be true or false");
    config.*k.field = value.get<bool>();
    return true;
  }
  for (const auto& k : kStringKeys) {
    if (key != k.name) continue;
    if (!value.is_string()) reject(key, value, std::string("must be a string, one of ") + k.allowed);
    config.*k.field = value.get<std::string>();
    return true;
  }
  return false;
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("LlamaConfig: expected a JSON object, got " + show(j));
  LlamaConfig config;
  std::optional<double> nested_rope_theta;
  for (const auto& [key, value] : j.items()) {
    if (key == kRopeKey) {
      if (!value.is_null()) nested_rope_theta = parse_rope_parameters(value, config.rope_scaling);
    } else if (!parse_scalar_key(key, value, config)) {
      reject(key, value, "is not a known key; known keys: " + known_keys());
    }
  }
  if (!j.contains("num_key_value_heads") || j["num_key_value_heads"].is_null()) {
    config.num_key_value_heads = config.num_attention_heads;
  }
  // A head_dim equal to the derived one is the derived one: one canonical form, whatever the source.
  if (config.num_attention_heads > 0 && config.head_dim_override * config.num_attention_heads == config.hidden_size) {
    config.head_dim_override = 0;
  }
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

ParamCounts param_counts(const LlamaConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t q = c.num_attention_heads * c.head_dim(), kv = c.num_key_value_heads * c.head_dim();
  ParamCounts p;
  p.per_layer = 2 * H * q + 2 * H * kv + 3 * H * I + 2 * H;  // q, o; k, v; mlp; two norms
  if (c.qkv_bias()) p.per_layer += q + 2 * kv;
  if (c.o_bias()) p.per_layer += H;
  if (c.qk_norm()) p.per_layer += 2 * c.head_dim();
  p.root = V * H + H + (c.tie_word_embeddings ? 0 : V * H);  // embedding, final norm, lm_head
  return p;
}

}  // namespace llama
