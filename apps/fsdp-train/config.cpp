// TrainConfig: defaults, strict JSON parsing with dotted-key errors, overrides, and the hash.
#include "config.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace train {
namespace {

using nlohmann::json;

[[noreturn]] void reject(const std::string& key, const json& value, const std::string& why) {
  // Strings are not checked for UTF-8 before this point: replace bad bytes rather than throw
  // nlohmann's type_error from inside the error path (found by fuzz/fuzz_config.cpp).
  throw std::invalid_argument("config: " + key + "=" + value.dump(-1, ' ', false, json::error_handler_t::replace) +
                              ": " + why);
}

// Reads the keys of one config section, recording which were used so that finish() can name the
// first unknown one. Every reader leaves its output at the default when the key is absent.
class SectionReader {
 public:
  SectionReader(const json& doc, std::string section) : section_(std::move(section)) {
    if (doc.contains(section_)) {
      const json& j = doc.at(section_);
      if (!j.is_object()) reject(section_, j, "must be an object");
      obj_ = &j;
    }
  }
  SectionReader(const json* obj, std::string section) : obj_(obj), section_(std::move(section)) {}

  std::string key(const char* name) const { return section_ + "." + name; }

  const json* find(const char* name) {
    known_.push_back(name);
    if (obj_ == nullptr || !obj_->contains(name)) return nullptr;
    return &obj_->at(name);
  }

  void integer(const char* name, int64_t& out, int64_t min) {
    const json* v = find(name);
    if (v == nullptr) return;
    const bool too_big =
        v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (!v->is_number_integer() || too_big) reject(key(name), *v, "must be an integer");
    out = v->get<int64_t>();
    if (out < min) reject(key(name), *v, "must be >= " + std::to_string(min));
  }

  void unsigned_integer(const char* name, uint64_t& out) {
    const json* v = find(name);
    if (v == nullptr) return;
    if (!v->is_number_integer() || (v->is_number_integer() && !v->is_number_unsigned() && v->get<int64_t>() < 0)) {
      reject(key(name), *v, "must be a non-negative integer");
    }
    out = v->get<uint64_t>();
  }

  // A finite number in [min, max]; `min_open` makes the lower bound exclusive.
  void number(const char* name, double& out, double min, bool min_open = false,
              double max = std::numeric_limits<double>::infinity()) {
    const json* v = find(name);
    if (v == nullptr) return;
    if (!v->is_number()) reject(key(name), *v, "must be a number");
    out = v->get<double>();
    check_range(key(name), *v, out, min, min_open, max);
  }

  void string(const char* name, std::string& out) {
    const json* v = find(name);
    if (v == nullptr) return;
    if (!v->is_string()) reject(key(name), *v, "must be a string");
    out = v->get<std::string>();
  }

  void choice(const char* name, std::string& out, const std::vector<std::string>& allowed) {
    const json* v = find(name);
    if (v == nullptr) return;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "\"" : ", \"") + a + "\"";
    if (!v->is_string()) reject(key(name), *v, "must be one of " + list);
    const auto s = v->get<std::string>();
    bool ok = false;
    for (const auto& a : allowed) ok = ok || s == a;
    if (!ok) reject(key(name), *v, "must be one of " + list);
    out = s;
  }

  template <class E, size_t N>
  void choice(const char* name, E& out, const Named<E> (&table)[N]) {
    std::string s = name_of(table, out);
    std::vector<std::string> allowed;
    for (const auto& t : table) allowed.push_back(t.name);
    choice(name, s, allowed);
    for (const auto& t : table)
      if (s == t.name) out = t.value;
  }

  static void check_range(const std::string& key, const json& v, double x, double min, bool min_open, double max) {
    if (!std::isfinite(x)) reject(key, v, "must be finite");
    if (min_open ? !(x > min) : !(x >= min)) {
      reject(key, v, std::string("must be ") + (min_open ? "> " : ">= ") + json(min).dump());
    }
    if (x > max) reject(key, v, "must be <= " + json(max).dump());
  }

  void finish() const {
    if (obj_ == nullptr) return;
    for (const auto& [k, v] : obj_->items()) {
      bool ok = false;
      for (const auto& name : known_) ok = ok || k == name;
      if (ok) continue;
      std::string list;
      for (const auto& name : known_) list += (list.empty() ? "" : ", ") + name;
      reject(section_ + "." + k, v, "unknown key (known keys in " + section_ + ": " + list + ")");
    }
  }

 private:
  const json* obj_ = nullptr;
  std::string section_;
  std::vector<std::string> known_;
};

// LlamaConfig::from_json starts from transformers' (Llama-2-7B) defaults; the trainer's start from
// default_model_config(), so the user's keys are laid over ours. As in transformers, leaving out
// num_key_value_heads means "as many as num_attention_heads", so a user who changes only the head
// count gets plain multi-head attention rather than our default's grouping.
llama::LlamaConfig parse_model(const json& doc) {
  json model = default_model_config().to_json();
  if (doc.contains("model")) {
    const json& user = doc.at("model");
    if (!user.is_object()) reject("model", user, "must be an object");
    if (user.contains("num_attention_heads") && !user.contains("num_key_value_heads")) {
      model.erase("num_key_value_heads");
    }
    for (const auto& [k, v] : user.items()) model[k] = v;
  }
  try {
    return llama::LlamaConfig::from_json(model);
  } catch (const std::invalid_argument& e) {
    // "LlamaConfig: key=value why" -> "config: model.key=value: why", the trainer's dotted form.
    std::string what = e.what();
    const std::string prefix = "LlamaConfig: ";
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    throw std::invalid_argument("config: model." + what);
  }
}

// One reader per section, run by from_json in this order after the model (data.seq_len is checked
// against it); each leaves a value at its default when the key is absent.

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

void parse_data(const json& doc, TrainConfig& c) {
  SectionReader data(doc, "data");
  data.choice("source", c.data.source, kDataSources);
  data.string("path", c.data.path);
  data.choice("token_dtype", c.data.token_dtype, kTokenDtypes);
  data.string("eval_path", c.data.eval_path);
  data.integer("seq_len", c.data.seq_len, 1);
  data.integer("batch_size_per_rank", c.data.batch_size_per_rank, 1);
  data.finish();
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

void parse_optim(const json& doc, TrainConfig& c) {
  SectionReader optim(doc, "optim");
  optim.number("lr", c.optim.lr, 0);
  if (const json* b = optim.find("betas")) {
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number()) {
      reject("optim.betas", *b, "must be a list of two numbers [beta1, beta2]");
    }
    for (int i = 0; i < 2; ++i) {
      c.optim.betas[i] = (*b)[i].get<double>();
      if (!(c.optim.betas[i] >= 0 && c.optim.betas[i] < 1)) reject("optim.betas", *b, "each beta must be in [0, 1)");
    }
  }
  optim.number("eps", c.optim.eps, 0, /*min_open=*/true);
  optim.number("weight_decay", c.optim.weight_decay, 0);
  optim.integer("warmup_steps", c.optim.warmup_steps, 0);
  optim.number("grad_clip", c.optim.grad_clip, 0);
  optim.choice("schedule", c.optim.schedule, kSchedules);
  optim.number("min_lr", c.optim.min_lr, 0);
  if (const json* v = optim.find("step_in_backward")) {
    if (!v->is_boolean()) reject(optim.key("step_in_backward"), *v, "must be true or false");
    c.optim.step_in_backward = v->get<bool>();
  }
  optim.finish();
  if (c.optim.min_lr > c.optim.lr) {
    reject("optim.min_lr", json(c.optim.min_lr), "exceeds optim.lr=" + json(c.optim.lr).dump());
  }
}

// An offload tier by its library name ("none", "host", "disk").
void offload_tier(SectionReader& o, const char* name, fsdp::OffloadTier& out) {
  std::string tier = fsdp::offload_tier_name(out);
  o.choice(name, tier, {"none", "host", "disk"});
  out = fsdp::parse_offload_tier(tier);
}

// fsdp.offload, read into the library's OffloadPolicy, which validates it (a disk tier needs dir).
void parse_offload(const json& off, fsdp::OffloadPolicy& out) {
  if (!off.is_object()) reject("fsdp.offload", off, "must be an object");
  SectionReader o(&off, "fsdp.offload");
  offload_tier(o, "params", out.params());
  offload_tier(o, "grads", out.grads());
  offload_tier(o, "optimizer_state", out.optimizer_state());
  o.string("dir", out.dir());
  o.integer("memory_budget_bytes", out.memory_budget_bytes(), 0);
  o.finish();
  try {
    out.validate();
  } catch (const fsdp::ConfigError& e) {
    throw std::invalid_argument(std::string("config: fsdp.offload: ") + e.what());
  }
}

void parse_debug(const json& dbg, FsdpConfig& out) {
  if (!dbg.is_object()) reject("fsdp.debug", dbg, "must be an object");
  SectionReader d(&dbg, "fsdp.debug");
  if (const json* v = d.find("check_collectives")) {
    if (!v->is_boolean()) reject(d.key("check_collectives"), *v, "must be true or false");
    out.check_collectives = v->get<bool>();
  }
  d.finish();
}

void parse_fsdp(const json& doc, TrainConfig& c) {
  SectionReader fs(doc, "fsdp");
  if (const json* s = fs.find("strategy")) {
    try {
      if (!s->is_string()) throw std::invalid_argument("");
      c.fsdp.strategy = fsdp::parse_strategy(s->get<std::string>());
    } catch (const std::exception&) {
      reject("fsdp.strategy", *s, "must be one of \"FULL_SHARD\", \"SHARD_GRAD_OP\", \"NO_SHARD\", \"HYBRID_SHARD\"");
    }
  }
  for (auto [name, out] : {std::pair<const char*, at::ScalarType*>{"param_dtype", &c.fsdp.param_dtype},
                           std::pair<const char*, at::ScalarType*>{"reduce_dtype", &c.fsdp.reduce_dtype}}) {
    if (const json* v = fs.find(name)) {
      if (!v->is_string()) reject(fs.key(name), *v, "must be one of \"float32\", \"bfloat16\", \"float16\"");
      *out = parse_dtype(fs.key(name), v->get<std::string>());
    }
  }
  fs.integer("prefetch_depth", c.fsdp.prefetch_depth, 0);
  fs.number("timeout_s", c.fsdp.timeout_s, 0, /*min_open=*/true);
  fs.integer("replicate", c.fsdp.replicate, 1);
  fs.choice("device", c.fsdp.device, {"cpu", "cuda"});
  fs.choice("loss_scale", c.fsdp.loss_scale, kLossScales);
  fs.number("loss_scale_init", c.fsdp.scaler.init_scale(), 0, /*min_open=*/true);
  fs.integer("loss_scale_growth_interval", c.fsdp.scaler.growth_interval(), 1);
  if (const json* off = fs.find("offload")) parse_offload(*off, c.fsdp.offload);
  if (const json* dbg = fs.find("debug")) parse_debug(*dbg, c.fsdp);
  fs.finish();
  if (c.fsdp.replicate > 1 && c.fsdp.strategy != fsdp::ShardingStrategy::kHybridShard) {
    reject("fsdp.replicate", json(c.fsdp.replicate),
           std::string("needs fsdp.strategy=\"HYBRID_SHARD\" (got \"") + fsdp::strategy_name(c.fsdp.strategy) + "\")");
  }
  if (c.fsdp.strategy == fsdp::ShardingStrategy::kHybridShard && c.fsdp.replicate < 2) {
    reject("fsdp.replicate", json(c.fsdp.replicate), "must be >= 2 with fsdp.strategy=\"HYBRID_SHARD\"");
  }
}

// train.activation_checkpointing: "none" (0), "every" (1) or n >= 0 (every n-th layer).
void parse_checkpointing(SectionReader& tr, int64_t& out) {
  const json* v = tr.find("activation_checkpointing");
  if (v == nullptr) return;
  if (v->is_string() && (*v == "none" || *v == "every")) {
    out = *v == "none" ? 0 : 1;
  } else if (v->is_number_integer() && v->get<int64_t>() >= 0) {
    out = v->get<int64_t>();
  } else {
    reject(tr.key("activation_checkpointing"), *v,
           "must be \"none\", \"every\" (every layer) or n >= 0 (layers 0, n, 2n, ...)");
  }
}

void parse_train(const json& doc, TrainConfig& c) {
  SectionReader tr(doc, "train");
  tr.unsigned_integer("seed", c.train.seed);
  tr.integer("steps", c.train.steps, 0);
  tr.integer("eval_every", c.train.eval_every, 0);
  tr.integer("eval_batches", c.train.eval_batches, 1);
  tr.integer("save_every", c.train.save_every, 0);
  tr.integer("keep_last", c.train.keep_last, 0);
  tr.integer("log_every", c.train.log_every, 1);
  tr.integer("grad_accum_steps", c.train.grad_accum_steps, 1);
  parse_checkpointing(tr, c.train.activation_checkpointing);
  if (const json* v = tr.find("async_save")) {
    if (!v->is_boolean()) reject(tr.key("async_save"), *v, "must be true or false");
    c.train.async_save = v->get<bool>();
  }
  tr.integer("max_consecutive_skips", c.fsdp.scaler.max_consecutive_skips(), 0);
  tr.finish();
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
  json j;
  j["model"] = model.to_json();
  j["data"] = {{"source", name_of(kDataSources, data.source)},
               {"path", data.path},
               {"token_dtype", name_of(kTokenDtypes, data.token_dtype)},
               {"eval_path", data.eval_path},
               {"seq_len", data.seq_len},
               {"batch_size_per_rank", data.batch_size_per_rank}};
  j["optim"] = {{"lr", optim.lr},
                {"betas", {optim.betas[0], optim.betas[1]}},
                {"eps", optim.eps},
                {"weight_decay", optim.weight_decay},
                {"warmup_steps", optim.warmup_steps},
                {"grad_clip", optim.grad_clip},
                {"schedule", name_of(kSchedules, optim.schedule)},
                {"min_lr", optim.min_lr},
                {"step_in_backward", optim.step_in_backward}};
  j["fsdp"] = {{"strategy", fsdp::strategy_name(this->fsdp.strategy)},
               {"param_dtype", dtype_name(this->fsdp.param_dtype)},
               {"reduce_dtype", dtype_name(this->fsdp.reduce_dtype)},
               {"prefetch_depth", this->fsdp.prefetch_depth},
               {"timeout_s", this->fsdp.timeout_s},
               {"replicate", this->fsdp.replicate},
               {"device", this->fsdp.device},
               {"offload",
                {{"params", fsdp::offload_tier_name(this->fsdp.offload.params())},
                 {"grads", fsdp::offload_tier_name(this->fsdp.offload.grads())},
                 {"optimizer_state", fsdp::offload_tier_name(this->fsdp.offload.optimizer_state())},
                 {"dir", this->fsdp.offload.dir()},
                 {"memory_budget_bytes", this->fsdp.offload.memory_budget_bytes()}}},
               {"debug", {{"check_collectives", this->fsdp.check_collectives}}},
               {"loss_scale", loss_scale_name(this->fsdp.loss_scale)},
               {"loss_scale_init", this->fsdp.scaler.init_scale()},
               {"loss_scale_growth_interval", this->fsdp.scaler.growth_interval()}};
  j["train"] = {
      {"seed", train.seed},
      {"steps", train.steps},
      {"eval_every", train.eval_every},
      {"eval_batches", train.eval_batches},
      {"save_every", train.save_every},
      {"keep_last", train.keep_last},
      {"log_every", train.log_every},
      {"grad_accum_steps", train.grad_accum_steps},
      {"activation_checkpointing", train.activation_checkpointing == 0   ? json("none")
                                   : train.activation_checkpointing == 1 ? json("every")
                                                                         : json(train.activation_checkpointing)},
      {"async_save", train.async_save},
      {"max_consecutive_skips", this->fsdp.scaler.max_consecutive_skips()}};
  return j;
}

TrainConfig TrainConfig::from_json(const json& doc) {
  if (!doc.is_object()) {
    throw std::invalid_argument("config: expected a JSON object, got " +
                                doc.dump(-1, ' ', false, json::error_handler_t::replace));
  }
  for (const auto& [k, v] : doc.items()) {
    if (k != "model" && k != "data" && k != "optim" && k != "fsdp" && k != "train") {
      reject(k, v, "unknown section (known sections: model, data, optim, fsdp, train)");
    }
  }
  TrainConfig c;
  c.model = parse_model(doc);

  parse_data(doc, c);
  parse_optim(doc, c);
  parse_fsdp(doc, c);
  parse_train(doc, c);
  c.fsdp.scaler.enabled(c.fsdp.loss_scaling());
  if (c.optim.step_in_backward && c.optim.grad_clip > 0) {
    reject("optim.step_in_backward", json(true),
           "needs optim.grad_clip 0 (got " + json(c.optim.grad_clip).dump() +
               "): each gradient is applied during backward, before the global norm is known");
  }
  if (c.optim.step_in_backward && c.fsdp.loss_scaling()) {
    reject("optim.step_in_backward", json(true),
           "needs fsdp.loss_scale \"none\" and no float16 params (got loss_scale \"" +
               std::string(loss_scale_name(c.fsdp.loss_scale)) +
               "\"): scaled gradients would be applied before they could be unscaled or skipped");
  }
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
// stack (found by tests/faults_e2e_test.sh). No config key nests deeper than 3, so text nested
// deeper than kMaxConfigDepth is refused before it is parsed.
namespace {
constexpr int kMaxConfigDepth = 64;

// Throws std::invalid_argument naming `what` when `text` nests arrays/objects too deeply.
void check_nesting(const std::string& text, const std::string& what) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') in_string = true;
    if (ch == '[' || ch == '{') {
      if (++depth > kMaxConfigDepth) {
        throw std::invalid_argument(what + ": nested deeper than " + std::to_string(kMaxConfigDepth) +
                                    " levels; no config value needs that");
      }
    }
    if (ch == ']' || ch == '}') --depth;
  }
}
}  // namespace

void set_dotted(json& doc, const std::string& dotted_key, const std::string& value) {
  if (dotted_key.empty() || dotted_key.front() == '.' || dotted_key.back() == '.' ||
      dotted_key.find("..") != std::string::npos) {
    throw std::invalid_argument("config: bad key '" + dotted_key + "' in --set (expected section.key=value)");
  }
  check_nesting(value, "config: --set " + dotted_key);  // See Note [Config nesting limit]
  json parsed = json::parse(value, nullptr, /*allow_exceptions=*/false);
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
  check_nesting(ss.str(), "config file '" + path + "'");  // See Note [Config nesting limit]
  try {
    doc = json::parse(ss.str());
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
