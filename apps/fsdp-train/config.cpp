// TrainConfig: defaults, strict JSON parsing with dotted-key errors (the sections' keys through the
// field table, config_fields.h; the model section through llama::LlamaConfig), overrides, the hash.
#include "config.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "config_fields.h"
#include "fsdp/errors.h"
#include "hf.h"

namespace train {
namespace {

using nlohmann::json;

// LlamaConfig::from_json starts from transformers' (Llama-2-7B) defaults; the trainer's start from
// default_model_config(), so the user's keys are laid over ours. As in transformers, leaving out
// num_key_value_heads means "as many as num_attention_heads", so a user who changes only the head
// count gets plain multi-head attention rather than our default's grouping. The section takes a
// published config.json's keys too (hidden_act, mlp_bias, rope_scaling, architectures, token ids,
// ...), each checked as an import checks it (llama::hf::model_keys), so a model's config.json can
// be pasted in as it is.
llama::LlamaConfig parse_model(const json& doc) {
  json model = default_model_config().to_json();
  // "LlamaConfig: key=value why" or "model: key=value why" -> "config: model.key=value why", the
  // trainer's dotted form.
  auto dotted = [](const std::invalid_argument& e) {
    std::string what = e.what();
    for (const std::string prefix : {"LlamaConfig: ", "model: "}) {
      if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    }
    return std::invalid_argument("config: model." + what);
  };
  if (doc.contains("model")) {
    const json& given = doc.at("model");
    if (!given.is_object()) reject("model", given, "must be an object");
    json user;
    try {
      user = llama::hf::model_keys(given, "model", model["model_type"].get<std::string>());
    } catch (const std::invalid_argument& e) {
      throw dotted(e);
    }
    if (user.contains("num_attention_heads") && !user.contains("num_key_value_heads")) {
      model.erase("num_key_value_heads");
    }
    for (const auto& [k, v] : user.items()) model[k] = v;
  }
  try {
    return llama::LlamaConfig::from_json(model);
  } catch (const std::invalid_argument& e) {
    throw dotted(e);
  }
}

// The cross-field checks, each run by from_json after its section's rows (config_fields.h).

// data.eval_path and data.token_dtype against the source and the file names.
void check_data_files(const DataConfig& d) {
  if (!d.eval_path.empty() && d.source != DataSource::kFile) {
    reject("data.eval_path", json(d.eval_path),
           "needs data.source=\"file\" (the synthetic task has its own eval split)");
  }
  auto is_bin = [](const std::string& p) { return p.size() >= 4 && p.compare(p.size() - 4, 4, ".bin") == 0; };
  if (d.token_dtype != TokenDtype::kUint16 && d.source == DataSource::kFile && !is_bin(d.path)) {
    reject("data.token_dtype", json(name_of(kTokenDtypes, d.token_dtype)),
           "applies to .bin token files, but data.path=\"" + d.path + "\" is read as raw bytes");
  }
  if (!d.eval_path.empty() && is_bin(d.eval_path) != is_bin(d.path)) {
    reject("data.eval_path", json(d.eval_path),
           "must have the same format as data.path (both .bin token files or neither)");
  }
}

void check_data(const TrainConfig& c) {
  if (c.data.source == DataSource::kFile && c.data.path.empty()) {
    reject("data.path", json(c.data.path), "must name a file when data.source is \"file\" (or pass --data FILE)");
  }
  if (c.data.source == DataSource::kSynthetic && !c.data.path.empty()) {
    reject("data.path", json(c.data.path), "is set but data.source is \"synthetic\"; set data.source to \"file\"");
  }
  check_data_files(c.data);
  if (c.data.seq_len > c.model.max_position_embeddings) {
    reject("data.seq_len", json(c.data.seq_len),
           "exceeds model.max_position_embeddings=" + std::to_string(c.model.max_position_embeddings));
  }
}

void check_optim(const TrainConfig& c) {
  if (c.optim.min_lr > c.optim.lr) {
    reject("optim.min_lr", json(c.optim.min_lr), "exceeds optim.lr=" + json(c.optim.lr).dump());
  }
}

// The lora section: the library's checks of its options (targets are checked against the model
// when it is built), and what a LoRA run cannot do.
void check_lora(const TrainConfig& c) {
  if (!c.lora.enabled) return;
  if (c.lora.dropout >= 1) reject("lora.dropout", json(c.lora.dropout), "must be < 1");
  if (c.lora.targets.empty()) reject("lora.targets", json(c.lora.targets), "must name at least one module");
}

// fsdp.offload, read into the library's OffloadPolicy, which validates it (a disk tier needs dir).
void check_offload(const fsdp::OffloadPolicy& offload) {
  try {
    offload.validate();
  } catch (const fsdp::ConfigError& e) {
    throw std::invalid_argument(std::string("config: fsdp.offload: ") + e.what());
  }
}

// fsdp.replicate against the strategy; whether it divides the world size is the library's check
// when the job joins (session.cpp).
void check_fsdp(const TrainConfig& c) {
  if (c.fsdp.replicate > 1 && c.fsdp.strategy != fsdp::ShardingStrategy::kHybridShard) {
    reject("fsdp.replicate", json(c.fsdp.replicate),
           std::string("needs fsdp.strategy=\"HYBRID_SHARD\" (got \"") + fsdp::strategy_name(c.fsdp.strategy) + "\")");
  }
  if (c.fsdp.strategy == fsdp::ShardingStrategy::kHybridShard && c.fsdp.replicate < 2) {
    reject("fsdp.replicate", json(c.fsdp.replicate), "must be >= 2 with fsdp.strategy=\"HYBRID_SHARD\"");
  }
  if (c.optim.state_dtype == at::kBFloat16 && c.fsdp.offload.optimizer_state() == fsdp::OffloadTier::kDisk) {
    reject("optim.state_dtype", json("bfloat16"),
           "cannot go with fsdp.offload.optimizer_state=\"disk\" (the disk tier streams float32 state): use "
           "\"none\" or \"host\", or optim.state_dtype=\"float32\"");
  }
}

// train.accumulation against the step in backward: there every backward that reduces gradients is
// an optimizer step, so micro-batches must accumulate without reducing.
void check_train(const TrainConfig& c) {
  if (c.optim.step_in_backward && c.train.grad_accum_steps > 1 && c.train.accumulation != fsdp::Accumulation::kNoSync) {
    reject("train.accumulation", json(fsdp::accumulation_name(c.train.accumulation)),
           "cannot go with optim.step_in_backward=true and several micro-batches (each backward that reduces "
           "is an optimizer step there): use \"no_sync\"");
  }
  if (c.train.save_in_step == Switch::kOn && c.train.async_save) {
    reject("train.save_in_step", json("on"),
           "cannot go with train.async_save=true (a background save writes a snapshot instead): set one of them off");
  }
}

// Reads one top-level section's rows, then runs `check`.
template <class Check>
void read_top_section(const json& doc, const char* name, TrainConfig& c, Check check) {
  read_section(section_object(doc, name), name, c, [&c](const std::string& nested) {
    if (nested == "fsdp.offload") check_offload(c.fsdp.offload);
  });
  check(c);
}

}  // namespace

llama::LlamaConfig default_model_config() {
  llama::LlamaConfig m;
  m.vocab_size = 256;  // byte-level: a text file trains with no tokenizer
  m.hidden_size = 128;
  m.intermediate_size = 384;
  m.num_hidden_layers = 4;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 4;
  m.max_position_embeddings = 1024;
  m.rms_norm_eps = 1e-5;
  m.rope_theta = 10000.0;
  m.tie_word_embeddings = false;
  m.initializer_range = 0.02;
  return m;
}

TrainConfig::TrainConfig() : model(default_model_config()) {}

at::ScalarType parse_dtype(const std::string& key, const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  reject(key, json(name), "must be one of \"float32\", \"bfloat16\", \"float16\"");
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return "float32";
  }
}

json TrainConfig::to_json() const {
  json j = write_fields(*this);
  j["model"] = model.to_json();
  return j;
}

TrainConfig TrainConfig::from_json(const json& doc) {
  if (!doc.is_object()) {
    throw std::invalid_argument("config: expected a JSON object, got " +
                                doc.dump(-1, ' ', false, json::error_handler_t::replace));
  }
  for (const auto& [k, v] : doc.items()) {
    if (k != "model" && k != "data" && k != "optim" && k != "fsdp" && k != "train" && k != "lora") {
      reject(k, v, "unknown section (known sections: model, data, optim, fsdp, train, lora)");
    }
  }
  TrainConfig c;
  c.model = parse_model(doc);
  read_top_section(doc, "data", c, check_data);  // after the model: data.seq_len is checked against it
  read_top_section(doc, "optim", c, check_optim);
  read_top_section(doc, "fsdp", c, check_fsdp);
  read_top_section(doc, "train", c, check_train);
  // A lora section turns LoRA on unless it says enabled: false.
  const json* lora = section_object(doc, "lora");
  c.lora.enabled = lora != nullptr;
  read_top_section(doc, "lora", c, check_lora);
  c.fsdp.scaler.enabled(c.fsdp.loss_scaling());
  // optim.step_in_backward against clipping and loss scaling is the library's check, asked when
  // the optimizer and the scaler exist (session.cpp).
  return c;
}

std::string TrainConfig::config_hash() const {
  json identity = {
      {"model", model.identity_json()},
      {"data", {{"source", name_of(kDataSources, data.source)}, {"path", data.path}, {"seq_len", data.seq_len}}}};
  // Only when not the default, so the hashes of configs older than the key stay as they were.
  if (data.token_dtype != TokenDtype::kUint16)
    identity["data"]["token_dtype"] = name_of(kTokenDtypes, data.token_dtype);
  // nlohmann's json keeps object keys sorted, so dump() is canonical.
  const std::string s = identity.dump(-1, ' ', false, json::error_handler_t::replace);  // a path may not be UTF-8
  uint64_t h = 1469598103934665603ULL;                                                  // FNV-1a 64-bit offset basis
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 1099511628211ULL;  // FNV prime
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// Note [Config nesting limit]
// nlohmann::json parses deep nesting iteratively but dumps and compares it recursively, and the
// errors here quote the offending value: a config value nested 100,000 levels deep overflowed the
// stack (found by tests/e2e/faults_e2e_test.sh). No config key nests deeper than 3, so the parser
// refuses text nested deeper than kMaxConfigDepth as it reaches that depth.
namespace {
constexpr int kMaxConfigDepth = 64;

// json::parse(text), refusing (std::invalid_argument naming `what`) arrays and objects nested deeper
// than kMaxConfigDepth as the parser reaches them. `allow_exceptions` as json::parse's.
json parse_shallow(const std::string& text, const std::string& what, bool allow_exceptions) {
  auto depth_check = [&what](int depth, json::parse_event_t, json&) {
    if (depth > kMaxConfigDepth) {
      throw std::invalid_argument(what + ": nested deeper than " + std::to_string(kMaxConfigDepth) +
                                  " levels; no config value needs that");
    }
    return true;
  };
  return json::parse(text, depth_check, allow_exceptions);
}
}  // namespace

void set_dotted(json& doc, const std::string& dotted_key, const std::string& value) {
  if (dotted_key.empty() || dotted_key.front() == '.' || dotted_key.back() == '.' ||
      dotted_key.find("..") != std::string::npos) {
    throw std::invalid_argument("config: bad key '" + dotted_key + "' in --set (expected section.key=value)");
  }
  // See Note [Config nesting limit].
  json parsed = parse_shallow(value, "config: --set " + dotted_key, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) parsed = value;
  json* node = &doc;
  std::string path;
  size_t start = 0;
  while (true) {
    const size_t dot = dotted_key.find('.', start);
    const std::string part = dotted_key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (node->is_null()) *node = json::object();
    if (!node->is_object()) {
      reject(path, *node, "is not an object, so --set " + dotted_key + "=... cannot set a key inside it");
    }
    path += (path.empty() ? "" : ".") + part;
    if (dot == std::string::npos) {
      (*node)[part] = parsed;
      return;
    }
    node = &(*node)[part];
    start = dot + 1;
  }
}

json read_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("config file '" + path + "': cannot be opened");
  std::stringstream ss;
  ss << in.rdbuf();
  json doc;
  try {
    doc = parse_shallow(ss.str(), "config file '" + path + "'", true);  // See Note [Config nesting limit]
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number such as 1e999
    throw std::invalid_argument("config file '" + path + "': not valid JSON: " + e.what());
  }
  if (!doc.is_object()) throw std::invalid_argument("config file '" + path + "': must hold a JSON object");
  return doc;
}

TrainConfig build_config(const json& file_doc, const std::vector<std::pair<std::string, std::string>>& overrides) {
  json doc = file_doc.is_null() ? json::object() : file_doc;
  for (const auto& [key, value] : overrides) set_dotted(doc, key, value);
  return TrainConfig::from_json(doc);
}

}  // namespace train
