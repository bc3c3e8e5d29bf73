// The config's field table (config_fields.h): the kinds of value a key takes and the rows;
// config_table.cpp reads and writes a config through them.
#include "config_fields.h"

#include "fsdp/errors.h"
#include "fsdp/optim.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace train {

using nlohmann::json;

void reject(const std::string& key, const json& value, const std::string& why) {
  // Strings are not checked for UTF-8 before this point: replace bad bytes rather than throw
  // nlohmann's type_error from inside the error path (found by fuzz/fuzz_config.cpp).
  throw std::invalid_argument("config: " + key + "=" + value.dump(-1, ' ', false, json::error_handler_t::replace) +
                              ": " + why);
}

namespace {

// ---- kinds of value: each returns a row reading and writing the member `ref(config)` names

// "\"a\", \"b\"" or "\"a\" / \"b\"".
std::string quoted_list(const std::vector<std::string>& names, const char* sep) {
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : sep) + ("\"" + n + "\"");
  return list;
}

template <class E, size_t N>
std::vector<std::string> names_of(const Named<E> (&table)[N]) {
  std::vector<std::string> out;
  for (const auto& t : table) out.push_back(t.name);
  return out;
}

template <class Ref>
ConfigField integer(const char* section, const char* key, Ref ref, int64_t min, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  auto read = [ref, min, dotted](TrainConfig& c, const json& v) {
    const bool too_big =
        v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (!v.is_number_integer() || too_big) reject(dotted, v, "must be an integer");
    if (v.get<int64_t>() < min) reject(dotted, v, "must be >= " + std::to_string(min));
    ref(c) = v.get<int64_t>();
  };
  return {section, key,  "integer >= " + std::to_string(min),
          help,    read, [ref](const TrainConfig& c) { return json(ref(c)); }};
}

template <class Ref>
ConfigField unsigned_integer(const char* section, const char* key, Ref ref, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  auto read = [ref, dotted](TrainConfig& c, const json& v) {
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0)) {
      reject(dotted, v, "must be a non-negative integer");
    }
    ref(c) = v.get<uint64_t>();
  };
  return {section, key, "integer >= 0", help, read, [ref](const TrainConfig& c) { return json(ref(c)); }};
}

// A finite number >= min (> min when min_open).
template <class Ref>
ConfigField number(const char* section, const char* key, Ref ref, double min, bool min_open, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  auto read = [ref, min, min_open, dotted](TrainConfig& c, const json& v) {
    if (!v.is_number()) reject(dotted, v, "must be a number");
    const double x = v.get<double>();
    if (!std::isfinite(x)) reject(dotted, v, "must be finite");
    if (min_open ? !(x > min) : !(x >= min)) {
      reject(dotted, v, std::string("must be ") + (min_open ? "> " : ">= ") + json(min).dump());
    }
    ref(c) = x;
  };
  return {section, key,  std::string("number ") + (min_open ? "> " : ">= ") + json(min).dump(),
          help,    read, [ref](const TrainConfig& c) { return json(ref(c)); }};
}

// `field` with its range left to the library: after reading, `check` builds the library's options
// from the config and validates them (fsdp::check_options), and a ConfigError becomes this key's
// error. `accepts` describes the range for --help.
template <class Check>
ConfigField checked_by(ConfigField field, std::string accepts, Check check) {
  auto read = [read = field.read, check, dotted = field.dotted()](TrainConfig& c, const json& v) {
    read(c, v);
    try {
      check(c);
    } catch (const fsdp::ConfigError& e) {
      std::string why = e.what();
      if (why.rfind("fsdp: ", 0) == 0) why.erase(0, 6);
      reject(dotted, v, why);
    }
  };
  field.read = read;
  field.accepts = std::move(accepts);
  return field;
}

constexpr double kAnyNumber = -std::numeric_limits<double>::infinity();
constexpr int64_t kAnyInteger = std::numeric_limits<int64_t>::min();

void check_adamw(const TrainConfig& c) { fsdp::check_options(c.optim.adamw()); }
void check_scaler(const TrainConfig& c) { fsdp::check_options(c.fsdp.scaler); }

template <class Ref>
ConfigField string(const char* section, const char* key, Ref ref, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  auto read = [ref, dotted](TrainConfig& c, const json& v) {
    if (!v.is_string()) reject(dotted, v, "must be a string");
    ref(c) = v.get<std::string>();
  };
  return {section, key, "string", help, read, [ref](const TrainConfig& c) { return json(ref(c)); }};
}

template <class Ref>
ConfigField string_list(const char* section, const char* key, Ref ref, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  auto read = [ref, dotted](TrainConfig& c, const json& v) {
    // --set passes text: a comma-separated list.
    if (v.is_string()) {
      std::vector<std::string> out;
      std::string item;
      for (char ch : v.get<std::string>() + ",") {
        if (ch != ',') {
          item += ch;
        } else if (!item.empty()) {
          out.push_back(item);
          item.clear();
        }
      }
      ref(c) = out;
      return;
    }
    if (!v.is_array()) reject(dotted, v, "must be a list of strings");
    std::vector<std::string> out;
    for (const auto& item : v) {
      if (!item.is_string()) reject(dotted, v, "must be a list of strings");
      out.push_back(item.get<std::string>());
    }
    ref(c) = out;
  };
  return {section, key, "list of strings", help, read, [ref](const TrainConfig& c) { return json(ref(c)); }};
}

template <class Ref>
ConfigField boolean(const char* section, const char* key, Ref ref, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  auto read = [ref, dotted](TrainConfig& c, const json& v) {
    if (!v.is_boolean()) reject(dotted, v, "must be true or false");
    ref(c) = v.get<bool>();
  };
  return {section, key, "true / false", help, read, [ref](const TrainConfig& c) { return json(ref(c)); }};
}

// One of `names`, stored through `from_name` (a name in the list) and written by `to_name`.
template <class Ref, class FromName, class ToName>
ConfigField choice(const char* section, const char* key, Ref ref, std::vector<std::string> names, FromName from_name,
                   ToName to_name, const char* help) {
  const std::string dotted = std::string(section) + "." + key;
  const std::string why = "must be one of " + quoted_list(names, ", ");
  auto read = [ref, names, from_name, dotted, why](TrainConfig& c, const json& v) {
    if (!v.is_string()) reject(dotted, v, why);
    const std::string s = v.get<std::string>();
    bool ok = false;
    for (const auto& n : names) ok = ok || s == n;
    if (!ok) reject(dotted, v, why);
    ref(c) = from_name(s);
  };
  return {section, key,  quoted_list(names, " / "),
          help,    read, [ref, to_name](const TrainConfig& c) { return json(to_name(ref(c))); }};
}

// A string field that must be one of `names`, stored as it is.
template <class Ref>
ConfigField string_choice(const char* section, const char* key, Ref ref, std::vector<std::string> names,
                          const char* help) {
  auto same = [](const std::string& s) { return s; };
  return choice(section, key, ref, std::move(names), same, same, help);
}

// An enum with a Named table (named.h).
template <class Ref, class E, size_t N>
ConfigField named(const char* section, const char* key, Ref ref, const Named<E> (&table)[N], const char* help) {
  // choice() has checked the name against the table already.
  auto from_name = [&table](const std::string& s) { return value_of(table, s).value_or(table[0].value); };
  return choice(
      section, key, ref, names_of(table), from_name, [&table](E e) { return name_of(table, e); }, help);
}

template <class Ref>
ConfigField offload_tier(const char* key, Ref ref, const char* help) {
  return choice("fsdp.offload", key, ref, {"none", "host", "disk"}, fsdp::parse_offload_tier, fsdp::offload_tier_name,
                help);
}

template <class Ref>
ConfigField dtype(const char* key, Ref ref, const char* help) {
  const std::string dotted = std::string("fsdp.") + key;
  auto read = [ref, dotted](TrainConfig& c, const json& v) {
    if (!v.is_string()) reject(dotted, v, "must be one of \"float32\", \"bfloat16\", \"float16\"");
    ref(c) = parse_dtype(dotted, v.get<std::string>());
  };
  return {"fsdp", key,  "\"float32\" / \"bfloat16\" / \"float16\"",
          help,   read, [ref](const TrainConfig& c) { return json(dtype_name(ref(c))); }};
}

ConfigField strategy() {
  auto read = [](TrainConfig& c, const json& v) {
    try {
      if (!v.is_string()) throw std::invalid_argument("");
      c.fsdp.strategy = fsdp::parse_strategy(v.get<std::string>());
    } catch (const std::exception&) {
      reject("fsdp.strategy", v, "must be one of \"FULL_SHARD\", \"SHARD_GRAD_OP\", \"NO_SHARD\", \"HYBRID_SHARD\"");
    }
  };
  return {"fsdp",
          "strategy",
          "\"FULL_SHARD\" / \"SHARD_GRAD_OP\" / \"NO_SHARD\" / \"HYBRID_SHARD\"",
          "how parameters, gradients and optimizer state are sharded",
          read,
          [](const TrainConfig& c) { return json(fsdp::strategy_name(c.fsdp.strategy)); }};
}

ConfigField betas() {
  auto read = [](TrainConfig& c, const json& b) {
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number()) {
      reject("optim.betas", b, "must be a list of two numbers [beta1, beta2]");
    }
    for (int i = 0; i < 2; ++i) c.optim.betas[i] = b[i].get<double>();
  };
  return checked_by({"optim", "betas", "", "AdamW's moment decay rates", read,
                     [](const TrainConfig& c) {
                       return json{c.optim.betas[0], c.optim.betas[1]};
                     }},
                    "[beta1, beta2], each in [0, 1)", check_adamw);
}

// train.activation_checkpointing: "none" (0), "every" (1) or n >= 0 (every n-th layer).
ConfigField activation_checkpointing() {
  auto read = [](TrainConfig& c, const json& v) {
    if (v.is_string() && (v == "none" || v == "every")) {
      c.train.activation_checkpointing = v == "none" ? 0 : 1;
    } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
      c.train.activation_checkpointing = v.get<int64_t>();
    } else {
      reject("train.activation_checkpointing", v,
             "must be \"none\", \"every\" (every layer) or n >= 0 (layers 0, n, 2n, ...)");
    }
  };
  auto write = [](const TrainConfig& c) {
    const int64_t n = c.train.activation_checkpointing;
    return n == 0 ? json("none") : n == 1 ? json("every") : json(n);
  };
  return {"train",
          "activation_checkpointing",
          "\"none\" / \"every\" / n >= 0",
          "recompute layers 0, n, 2n, ... in backward instead of keeping their activations",
          read,
          write};
}

std::vector<ConfigField> data_fields() {
  return {
      named(
          "data", "source", [](auto& c) -> auto& { return c.data.source; }, kDataSources,
          "the built-in synthetic task, or data.path (--data FILE sets both)"),
      string(
          "data", "path", [](auto& c) -> auto& { return c.data.path; },
          "the training file: .bin token ids (data.token_dtype), else raw bytes"),
      named(
          "data", "token_dtype", [](auto& c) -> auto& { return c.data.token_dtype; }, kTokenDtypes,
          "the width of a .bin file's tokens (uint32 for vocabularies above 65,536)"),
      string(
          "data", "eval_path", [](auto& c) -> auto& { return c.data.eval_path; },
          "a held-out file for evaluation (empty: the last 10% of data.path)"),
      integer(
          "data", "seq_len", [](auto& c) -> auto& { return c.data.seq_len; }, 1, "tokens per sample"),
      integer(
          "data", "batch_size_per_rank", [](auto& c) -> auto& { return c.data.batch_size_per_rank; }, 1,
          "samples per rank per micro-batch"),
  };
}

std::vector<ConfigField> optim_fields() {
  return {
      checked_by(
          number(
              "optim", "lr", [](auto& c) -> auto& { return c.optim.lr; }, kAnyNumber, false, "peak learning rate"),
          "number >= 0", check_adamw),
      betas(),
      checked_by(
          number(
              "optim", "eps", [](auto& c) -> auto& { return c.optim.eps; }, kAnyNumber, false, "AdamW's epsilon"),
          "number >= 0", check_adamw),
      checked_by(number(
                     "optim", "weight_decay", [](auto& c) -> auto& { return c.optim.weight_decay; }, kAnyNumber, false,
                     "AdamW's decoupled weight decay"),
                 "number >= 0", check_adamw),
      checked_by(integer(
                     "optim", "warmup_steps", [](auto& c) -> auto& { return c.optim.warmup_steps; }, kAnyInteger,
                     "steps of linear warmup to optim.lr"),
                 "integer >= 0",
                 [](const TrainConfig& c) {
                   fsdp::WarmupCosine(c.optim.lr, c.optim.warmup_steps, std::max<int64_t>(c.train.steps, 0),
                                      c.optim.min_lr);
                 }),
      number(
          "optim", "grad_clip", [](auto& c) -> auto& { return c.optim.grad_clip; }, 0, false,
          "max global gradient norm (0: no clipping)"),
      named(
          "optim", "schedule", [](auto& c) -> auto& { return c.optim.schedule; }, kSchedules,
          "after warmup: cosine decay to optim.min_lr at train.steps, or constant"),
      number(
          "optim", "min_lr", [](auto& c) -> auto& { return c.optim.min_lr; }, 0, false,
          "the cosine schedule's final learning rate (<= optim.lr)"),
      boolean(
          "optim", "step_in_backward", [](auto& c) -> auto& { return c.optim.step_in_backward; },
          "step each unit as soon as its gradient is reduced (needs grad_clip 0, no loss scaling)"),
      choice(
          "optim", "state_dtype", [](auto& c) -> auto& { return c.optim.state_dtype; }, {"float32", "bfloat16"},
          [](const std::string& s) { return s == "bfloat16" ? at::kBFloat16 : at::kFloat; },
          [](at::ScalarType t) { return std::string(t == at::kBFloat16 ? "bfloat16" : "float32"); },
          "AdamW's moments: float32, or bfloat16 with stochastic rounding (4 bytes less per trainable "
          "parameter; not with fsdp.offload.optimizer_state \"disk\")"),
  };
}

ConfigField reshard_after_forward_group() {
  return integer(
      "fsdp", "reshard_after_forward_group", [](auto& c) -> auto& { return c.fsdp.reshard_after_forward_group; }, 0,
      "after forward each layer stays sharded over groups of this many consecutive ranks (one node's), so "
      "backward's all-gather runs inside the group; 0: off; must divide the shard group's size");
}

ConfigField split_root() {
  return string_choice(
      "fsdp", "split_root", [](auto& c) -> auto& { return c.fsdp.split_root; }, {"auto", "on", "off"},
      "the embedding and the head sharded as units of their own, out of the root (not with tied embeddings); "
      "auto: when the head is untied and the plan's peak is lower");
}

ConfigField vocab_parallel() {
  return string_choice(
      "fsdp", "vocab_parallel", [](auto& c) -> auto& { return c.fsdp.vocab_parallel; }, {"auto", "on", "off"},
      "the frozen embedding and head never gathered: each rank looks up and computes the logits of the rows it "
      "holds (fsdp/vocab_parallel.h); auto: whenever they are frozen (LoRA without lm_head among its targets)");
}

ConfigField save_in_step() {
  return string_choice(
      "train", "save_in_step", [](auto& c) -> auto& { return c.train.save_in_step; }, {"auto", "on", "off"},
      "a checkpoint's trainable shards written during the optimizer step before it, as the step holds them "
      "(not with async_save); auto: when a master or optimizer state is in the disk tier");
}

ConfigField device() {
  return string_choice(
      "fsdp", "device", [](auto& c) -> auto& { return c.fsdp.device; }, {"cpu", "cuda"},
      "\"cpu\": Gloo; \"cuda\": NCCL, rank r on CUDA device LOCAL_RANK");
}

std::vector<ConfigField> fsdp_fields() {
  return {
      strategy(),
      dtype(
          "param_dtype", [](auto& c) -> auto& { return c.fsdp.param_dtype; }, "compute dtype of gathered parameters"),
      dtype(
          "reduce_dtype", [](auto& c) -> auto& { return c.fsdp.reduce_dtype; }, "dtype gradients are reduced in"),
      integer(
          "fsdp", "prefetch_depth", [](auto& c) -> auto& { return c.fsdp.prefetch_depth; }, 0,
          "units whose all-gather is issued ahead (0: off)"),
      checked_by(number(
                     "fsdp", "timeout_s", [](auto& c) -> auto& { return c.fsdp.timeout_s; }, kAnyNumber, false,
                     "seconds for the rendezvous and every collective"),
                 "number >= 0.001", [](const TrainConfig& c) { fsdp::check_options(c.fsdp.init_options()); }),
      integer(
          "fsdp", "replicate", [](auto& c) -> auto& { return c.fsdp.replicate; }, 1,
          "HYBRID_SHARD: replicas (rows of the mesh); must divide the world size"),
      reshard_after_forward_group(),
      split_root(),
      vocab_parallel(),
      device(),
      named(
          "fsdp", "loss_scale", [](auto& c) -> auto& { return c.fsdp.loss_scale; }, kLossScales,
          "dynamic loss scaling: when param_dtype is float16 (auto), always, or never"),
      checked_by(number(
                     "fsdp", "loss_scale_init", [](auto& c) -> auto& { return c.fsdp.scaler.init_scale(); }, kAnyNumber,
                     false, "the first loss scale"),
                 "number > 0", check_scaler),
      checked_by(
          integer(
              "fsdp", "loss_scale_growth_interval", [](auto& c) -> auto& { return c.fsdp.scaler.growth_interval(); },
              kAnyInteger, "good steps in a row before the scale doubles"),
          "integer >= 1", check_scaler),
      offload_tier(
          "params", [](auto& c) -> auto& { return c.fsdp.offload.params(); },
          "where the fp32 master parameter shards live"),
      offload_tier(
          "grads", [](auto& c) -> auto& { return c.fsdp.offload.grads(); }, "where gradient shards live"),
      offload_tier(
          "optimizer_state", [](auto& c) -> auto& { return c.fsdp.offload.optimizer_state(); },
          "where the optimizer state lives"),
      string(
          "fsdp.offload", "dir", [](auto& c) -> auto& { return c.fsdp.offload.dir(); },
          "the directory of the disk tier's files (needed by \"disk\")"),
      checked_by(integer(
                     "fsdp.offload", "memory_budget_bytes",
                     [](auto& c) -> auto& { return c.fsdp.offload.memory_budget_bytes(); }, kAnyInteger,
                     "disk-tier bytes in memory during the optimizer step (0: 4 MiB chunks)"),
                 "integer >= 0",
                 [](const TrainConfig& c) {
                   // The budget alone: the tiers and dir are checked once the whole section is read.
                   fsdp::OffloadPolicy().memory_budget_bytes(c.fsdp.offload.memory_budget_bytes()).validate();
                 }),
      boolean(
          "fsdp.debug", "check_collectives", [](auto& c) -> auto& { return c.fsdp.check_collectives; },
          "check that every rank issues the same collectives in the same order"),
  };
}

std::vector<ConfigField> train_fields() {
  return {
      unsigned_integer(
          "train", "seed", [](auto& c) -> auto& { return c.train.seed; }, "parameter init and data order"),
      integer(
          "train", "steps", [](auto& c) -> auto& { return c.train.steps; }, 0, "optimizer steps to reach"),
      integer(
          "train", "eval_every", [](auto& c) -> auto& { return c.train.eval_every; }, 0,
          "steps between evaluations (0: none)"),
      integer(
          "train", "eval_batches", [](auto& c) -> auto& { return c.train.eval_batches; }, 1,
          "global batches per evaluation"),
      integer(
          "train", "save_every", [](auto& c) -> auto& { return c.train.save_every; }, 0,
          "steps between checkpoints (0: at the end only; needs --save-dir)"),
      integer(
          "train", "keep_last", [](auto& c) -> auto& { return c.train.keep_last; }, 0,
          "committed checkpoints to keep (0: all)"),
      integer(
          "train", "log_every", [](auto& c) -> auto& { return c.train.log_every; }, 1,
          "steps between log lines when stdout is not a terminal"),
      integer(
          "train", "grad_accum_steps", [](auto& c) -> auto& { return c.train.grad_accum_steps; }, 1,
          "micro-batches per optimizer step"),
      choice(
          "train", "accumulation", [](auto& c) -> auto& { return c.train.accumulation; },
          {"no_sync", "reduce_scatter", "reduce"}, fsdp::parse_accumulation, fsdp::accumulation_name,
          "micro-batches' gradients: kept unreduced until the last (no_sync), reduce-scattered each with "
          "HYBRID_SHARD's all-reduce on the last only (reduce_scatter), or reduced in full each (reduce)"),
      boolean(
          "train", "keep_gathered", [](auto& c) -> auto& { return c.train.keep_gathered; },
          "keep every unit's gathered parameters across the micro-batches of a step (one all-gather per unit "
          "per step; every unit gathered at once)"),
      activation_checkpointing(),
      integer(
          "train", "loss_chunk_tokens", [](auto& c) -> auto& { return c.train.loss_chunk_tokens; }, 0,
          "the head and the loss over this many tokens at a time, so the whole logits never exist (0: whole)"),
      boolean(
          "train", "async_save", [](auto& c) -> auto& { return c.train.async_save; },
          "write checkpoints in the background (one in flight)"),
      save_in_step(),
      checked_by(
          integer(
              "train", "max_consecutive_skips", [](auto& c) -> auto& { return c.fsdp.scaler.max_consecutive_skips(); },
              kAnyInteger, "non-finite steps in a row that stop the run (0: never)"),
          "integer >= 0", check_scaler),
      integer(
          "train.budget", "host_bytes", [](auto& c) -> auto& { return c.train.budget_host_bytes; }, 0,
          "per-rank host RAM the plan must fit (0: MemAvailable / ranks on the node)"),
      integer(
          "train.budget", "device_bytes", [](auto& c) -> auto& { return c.train.budget_device_bytes; }, 0,
          "per-rank device memory the plan must fit on cuda (0: not checked)"),
      integer(
          "train.budget", "disk_bytes", [](auto& c) -> auto& { return c.train.budget_disk_bytes; }, 0,
          "per-rank disk the plan's disk tier must fit (0: free space under fsdp.offload.dir / ranks)"),
      boolean(
          "train.budget", "check", [](auto& c) -> auto& { return c.train.check_budget; },
          "refuse to start, before allocating, when the plan does not fit the budgets"),
  };
}

std::vector<ConfigField> lora_fields() {
  return {
      boolean(
          "lora", "enabled", [](auto& c) -> auto& { return c.lora.enabled; },
          "train LoRA adapters on a frozen base (on when the config has a lora section)"),
      string_list(
          "lora", "targets", [](auto& c) -> auto& { return c.lora.targets; },
          "module name patterns of the Linears to adapt (a suffix such as \"q_proj\", or a regex)"),
      integer(
          "lora", "r", [](auto& c) -> auto& { return c.lora.r; }, 1, "the adapters' rank"),
      number(
          "lora", "alpha", [](auto& c) -> auto& { return c.lora.alpha; }, 0, true,
          "the adapters' output scale is alpha / r"),
      number(
          "lora", "dropout", [](auto& c) -> auto& { return c.lora.dropout; }, 0, false,
          "dropout on the adapters' input in training (< 1)"),
      choice(
          "lora", "base_dtype", [](auto& c) -> auto& { return c.lora.base_dtype; },
          {"bfloat16", "float16", "float32", "int8", "nf4"}, fsdp::parse_frozen_storage, fsdp::frozen_storage_name,
          "how the frozen base is kept (int8, nf4: the targets' weights, in blocks of 64)"),
      boolean(
          "lora", "save_base", [](auto& c) -> auto& { return c.lora.save_base; },
          "checkpoints hold the frozen base too (else the adapters and their optimizer state only)"),
      boolean(
          "lora", "replicate_adapters", [](auto& c) -> auto& { return c.lora.replicate_adapters; },
          "keep the adapters whole on every rank and all-reduce their gradients, instead of sharding them"),
      string(
          "lora", "adapter_from", [](auto& c) -> auto& { return c.lora.adapter_from; },
          "a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from"),
  };
}

}  // namespace

const std::vector<ConfigField>& config_fields() {
  static const std::vector<ConfigField> rows = [] {
    std::vector<ConfigField> all;
    for (auto part : {data_fields(), optim_fields(), fsdp_fields(), train_fields(), lora_fields()}) {
      for (auto& f : part) all.push_back(std::move(f));
    }
    return all;
  }();
  return rows;
}

}  // namespace train
