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

// A row's reference to the config member it reads and writes, and the three leading arguments of a
// row whose key is SECTION.KEY and whose member is c.SECTION.KEY.
#define MEMBER(member) \
  [](auto& c) -> auto& { return c.member; }
#define FIELD(section, key) #section, #key, MEMBER(section.key)

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

// A row of the member `ref(config)` names: `get(dotted_key, value)` reads a value (rejecting a bad
// one), `put(member)` gives what the dump holds.
template <class Ref, class Get, class Put>
ConfigField row(const char* section, const char* key, Ref ref, std::string accepts, const char* help, Get get,
                Put put) {
  const std::string dotted = std::string(section) + "." + key;
  return {section,
          key,
          std::move(accepts),
          help,
          [ref, get, dotted](TrainConfig& c, const json& v) { ref(c) = get(dotted, v); },
          [ref, put](const TrainConfig& c) { return json(put(ref(c))); }};
}

const auto as_is = [](const auto& member) { return member; };

template <class Ref>
ConfigField integer(const char* section, const char* key, Ref ref, int64_t min, const char* help) {
  auto get = [min](const std::string& dotted, const json& v) {
    const bool too_big =
        v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (!v.is_number_integer() || too_big) reject(dotted, v, "must be an integer");
    if (v.get<int64_t>() < min) reject(dotted, v, "must be >= " + std::to_string(min));
    return v.get<int64_t>();
  };
  return row(section, key, ref, "integer >= " + std::to_string(min), help, get, as_is);
}

template <class Ref>
ConfigField unsigned_integer(const char* section, const char* key, Ref ref, const char* help) {
  auto get = [](const std::string& dotted, const json& v) {
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0)) {
      reject(dotted, v, "must be a non-negative integer");
    }
    return v.get<uint64_t>();
  };
  return row(section, key, ref, "integer >= 0", help, get, as_is);
}

// A finite number >= min (> min when min_open).
template <class Ref>
ConfigField number(const char* section, const char* key, Ref ref, double min, bool min_open, const char* help) {
  const std::string bound = std::string(min_open ? "> " : ">= ") + json(min).dump();
  auto get = [min, min_open, bound](const std::string& dotted, const json& v) {
    if (!v.is_number()) reject(dotted, v, "must be a number");
    const double x = v.get<double>();
    if (!std::isfinite(x)) reject(dotted, v, "must be finite");
    if (min_open ? !(x > min) : !(x >= min)) reject(dotted, v, "must be " + bound);
    return x;
  };
  return row(section, key, ref, "number " + bound, help, get, as_is);
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
  auto get = [](const std::string& dotted, const json& v) {
    if (!v.is_string()) reject(dotted, v, "must be a string");
    return v.get<std::string>();
  };
  return row(section, key, ref, "string", help, get, as_is);
}

template <class Ref>
ConfigField string_list(const char* section, const char* key, Ref ref, const char* help) {
  auto get = [](const std::string& dotted, const json& v) {
    std::vector<std::string> out;
    if (v.is_string()) {  // --set passes text: a comma-separated list
      std::string item;
      for (char ch : v.get<std::string>() + ",") {
        if (ch != ',') {
          item += ch;
        } else if (!item.empty()) {
          out.push_back(item);
          item.clear();
        }
      }
      return out;
    }
    if (!v.is_array()) reject(dotted, v, "must be a list of strings");
    for (const auto& item : v) {
      if (!item.is_string()) reject(dotted, v, "must be a list of strings");
      out.push_back(item.get<std::string>());
    }
    return out;
  };
  return row(section, key, ref, "list of strings", help, get, as_is);
}

template <class Ref>
ConfigField boolean(const char* section, const char* key, Ref ref, const char* help) {
  auto get = [](const std::string& dotted, const json& v) {
    if (!v.is_boolean()) reject(dotted, v, "must be true or false");
    return v.get<bool>();
  };
  return row(section, key, ref, "true / false", help, get, as_is);
}

// One of `names`, stored through `from_name` (a name in the list) and written by `to_name`.
template <class Ref, class FromName, class ToName>
ConfigField choice(const char* section, const char* key, Ref ref, std::vector<std::string> names, FromName from_name,
                   ToName to_name, const char* help) {
  const std::string why = "must be one of " + quoted_list(names, ", ");
  auto get = [names, from_name, why](const std::string& dotted, const json& v) {
    if (!v.is_string() || std::find(names.begin(), names.end(), v.get<std::string>()) == names.end()) {
      reject(dotted, v, why);
    }
    return from_name(v.get<std::string>());
  };
  return row(section, key, ref, quoted_list(names, " / "), help, get, to_name);
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
  auto get = [](const std::string& dotted, const json& v) {
    if (!v.is_string()) reject(dotted, v, "must be one of \"float32\", \"bfloat16\", \"float16\"");
    return parse_dtype(dotted, v.get<std::string>());
  };
  return row("fsdp", key, ref, "\"float32\" / \"bfloat16\" / \"float16\"", help, get, dtype_name);
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
      named(FIELD(data, source), kDataSources, "the built-in synthetic task, or data.path (--data FILE sets both)"),
      string(FIELD(data, path), "the training file: .bin token ids (data.token_dtype), else raw bytes"),
      named(FIELD(data, token_dtype), kTokenDtypes,
            "the width of a .bin file's tokens (uint32 for vocabularies above 65,536)"),
      string(FIELD(data, eval_path), "a held-out file for evaluation (empty: the last 10% of data.path)"),
      integer(FIELD(data, seq_len), 1, "tokens per sample"),
      integer(FIELD(data, batch_size_per_rank), 1, "samples per rank per micro-batch"),
  };
}

std::vector<ConfigField> optim_fields() {
  return {
      checked_by(number(FIELD(optim, lr), kAnyNumber, false, "peak learning rate"), "number >= 0", check_adamw),
      betas(),
      checked_by(number(FIELD(optim, eps), kAnyNumber, false, "AdamW's epsilon"), "number >= 0", check_adamw),
      checked_by(number(FIELD(optim, weight_decay), kAnyNumber, false, "AdamW's decoupled weight decay"), "number >= 0",
                 check_adamw),
      checked_by(integer(FIELD(optim, warmup_steps), kAnyInteger, "steps of linear warmup to optim.lr"), "integer >= 0",
                 [](const TrainConfig& c) {
                   fsdp::WarmupCosine(c.optim.lr, c.optim.warmup_steps, std::max<int64_t>(c.train.steps, 0),
                                      c.optim.min_lr);
                 }),
      number(FIELD(optim, grad_clip), 0, false, "max global gradient norm (0: no clipping)"),
      named(FIELD(optim, schedule), kSchedules,
            "after warmup: cosine decay to optim.min_lr at train.steps, or constant"),
      number(FIELD(optim, min_lr), 0, false, "the cosine schedule's final learning rate (<= optim.lr)"),
      boolean(FIELD(optim, step_in_backward),
              "step each unit as soon as its gradient is reduced (needs grad_clip 0, no loss scaling)"),
      choice(
          FIELD(optim, state_dtype), {"float32", "bfloat16"},
          [](const std::string& s) { return s == "bfloat16" ? at::kBFloat16 : at::kFloat; },
          [](at::ScalarType t) { return std::string(t == at::kBFloat16 ? "bfloat16" : "float32"); },
          "AdamW's moments: float32, or bfloat16 with stochastic rounding (4 bytes less per trainable "
          "parameter; not with fsdp.offload.optimizer_state \"disk\")"),
  };
}

std::vector<ConfigField> fsdp_fields() {
  return {
      strategy(),
      dtype("param_dtype", MEMBER(fsdp.param_dtype), "compute dtype of gathered parameters"),
      dtype("reduce_dtype", MEMBER(fsdp.reduce_dtype), "dtype gradients are reduced in"),
      integer(FIELD(fsdp, prefetch_depth), 0, "units whose all-gather is issued ahead (0: off)"),
      checked_by(number(FIELD(fsdp, timeout_s), kAnyNumber, false, "seconds for the rendezvous and every collective"),
                 "number >= 0.001", [](const TrainConfig& c) { fsdp::check_options(c.fsdp.init_options()); }),
      integer(FIELD(fsdp, replicate), 1, "HYBRID_SHARD: replicas (rows of the mesh); must divide the world size"),
      integer(FIELD(fsdp, reshard_after_forward_group), 0,
              "after forward each layer stays sharded over groups of this many consecutive ranks (one node's), so "
              "backward's all-gather runs inside the group; 0: off; must divide the shard group's size"),
      named(FIELD(fsdp, split_root), kSwitches,
            "the embedding and the head sharded as units of their own, out of the root (not with tied embeddings); "
            "auto: when the head is untied and the plan's peak is lower"),
      named(FIELD(fsdp, vocab_parallel), kSwitches,
            "the frozen embedding and head never gathered: each rank looks up and computes the logits of the rows it "
            "holds (fsdp/vocab_parallel.h); auto: whenever they are frozen (LoRA without lm_head among its targets)"),
      choice(FIELD(fsdp, device), {"cpu", "cuda"}, as_is, as_is,
             "\"cpu\": Gloo; \"cuda\": NCCL, rank r on CUDA device LOCAL_RANK"),
      named(FIELD(fsdp, loss_scale), kLossScales,
            "dynamic loss scaling: when param_dtype is float16 (auto), always, or never"),
      checked_by(number("fsdp", "loss_scale_init", MEMBER(fsdp.scaler.init_scale()), kAnyNumber, false,
                        "the first loss scale"),
                 "number > 0", check_scaler),
      checked_by(integer("fsdp", "loss_scale_growth_interval", MEMBER(fsdp.scaler.growth_interval()), kAnyInteger,
                         "good steps in a row before the scale doubles"),
                 "integer >= 1", check_scaler),
      offload_tier(
          "params", MEMBER(fsdp.offload.params()),
          "where the parameter shards live: fp32 masters, and a frozen base in its stored form (bf16, int8, NF4)"),
      offload_tier("grads", MEMBER(fsdp.offload.grads()), "where gradient shards live"),
      offload_tier("optimizer_state", MEMBER(fsdp.offload.optimizer_state()), "where the optimizer state lives"),
      string("fsdp.offload", "dir", MEMBER(fsdp.offload.dir()),
             "the directory of the disk tier's files (needed by \"disk\")"),
      checked_by(integer("fsdp.offload", "memory_budget_bytes", MEMBER(fsdp.offload.memory_budget_bytes()), kAnyInteger,
                         "disk-tier bytes in memory during the optimizer step (0: 4 MiB chunks)"),
                 "integer >= 0",
                 [](const TrainConfig& c) {
                   // The budget alone: the tiers and dir are checked once the whole section is read.
                   fsdp::OffloadPolicy().memory_budget_bytes(c.fsdp.offload.memory_budget_bytes()).validate();
                 }),
      boolean("fsdp.debug", "check_collectives", MEMBER(fsdp.check_collectives),
              "check that every rank issues the same collectives in the same order"),
  };
}

std::vector<ConfigField> train_fields() {
  return {
      unsigned_integer(FIELD(train, seed), "parameter init and data order"),
      integer(FIELD(train, steps), 0, "optimizer steps to reach"),
      integer(FIELD(train, eval_every), 0, "steps between evaluations (0: none)"),
      integer(FIELD(train, eval_batches), 1, "global batches per evaluation"),
      integer(FIELD(train, save_every), 0, "steps between checkpoints (0: at the end only; needs --save-dir)"),
      integer(FIELD(train, keep_last), 0, "committed checkpoints to keep (0: all)"),
      integer(FIELD(train, log_every), 1, "steps between log lines when stdout is not a terminal"),
      integer(FIELD(train, grad_accum_steps), 1, "micro-batches per optimizer step"),
      choice(FIELD(train, accumulation), {"no_sync", "reduce_scatter", "reduce"}, fsdp::parse_accumulation,
             fsdp::accumulation_name,
             "micro-batches' gradients: kept unreduced until the last (no_sync), reduce-scattered each with "
             "HYBRID_SHARD's all-reduce on the last only (reduce_scatter), or reduced in full each (reduce)"),
      boolean(FIELD(train, keep_gathered),
              "keep every unit's gathered parameters across the micro-batches of a step (one all-gather per unit "
              "per step; every unit gathered at once)"),
      activation_checkpointing(),
      integer(FIELD(train, loss_chunk_tokens), 0,
              "the head and the loss over this many tokens at a time, so the whole logits never exist (0: whole)"),
      boolean(FIELD(train, async_save), "write checkpoints in the background (one in flight)"),
      named(FIELD(train, save_in_step), kSwitches,
            "a checkpoint's trainable shards written during the optimizer step before it, as the step holds them "
            "(not with async_save); auto: when a master or optimizer state is in the disk tier"),
      checked_by(integer("train", "max_consecutive_skips", MEMBER(fsdp.scaler.max_consecutive_skips()), kAnyInteger,
                         "non-finite steps in a row that stop the run (0: never)"),
                 "integer >= 0", check_scaler),
      integer("train.budget", "host_bytes", MEMBER(train.budget_host_bytes), 0,
              "per-rank host RAM the plan must fit (0: MemAvailable / ranks on the node)"),
      integer("train.budget", "device_bytes", MEMBER(train.budget_device_bytes), 0,
              "per-rank device memory the plan must fit on cuda (0: not checked)"),
      integer("train.budget", "disk_bytes", MEMBER(train.budget_disk_bytes), 0,
              "per-rank disk the plan's disk tier must fit (0: free space under fsdp.offload.dir / ranks)"),
      boolean("train.budget", "check", MEMBER(train.check_budget),
              "refuse to start, before allocating, when the plan does not fit the budgets"),
      checked_by(number("train.budget", "margin_pct", MEMBER(train.budget_margin_pct), 0, false,
                        "percent of the device's budget (on cpu the host's) held free for what the plan "
                        "does not count, as fsdp-plan --margin"),
                 "number in [0, 90]",
                 [](const TrainConfig& c) {
                   if (c.train.budget_margin_pct > 90) throw fsdp::ConfigError("fsdp: must be at most 90");
                 }),
  };
}

std::vector<ConfigField> lora_fields() {
  return {
      boolean(FIELD(lora, enabled), "train LoRA adapters on a frozen base (on when the config has a lora section)"),
      string_list(FIELD(lora, targets),
                  "module name patterns of the Linears to adapt (a suffix such as \"q_proj\", or a regex)"),
      integer(FIELD(lora, r), 1, "the adapters' rank"),
      number(FIELD(lora, alpha), 0, true, "the adapters' output scale is alpha / r"),
      number(FIELD(lora, dropout), 0, false, "dropout on the adapters' input in training (< 1)"),
      choice(FIELD(lora, base_dtype), {"bfloat16", "float16", "float32", "int8", "nf4"}, fsdp::parse_frozen_storage,
             fsdp::frozen_storage_name,
             "how the frozen base is kept (int8, nf4: the targets' weights, in blocks of 64)"),
      boolean(FIELD(lora, save_base),
              "checkpoints hold the frozen base too (else the adapters and their optimizer state only)"),
      boolean(FIELD(lora, base_in_place),
              "a bitsandbytes 4-bit --init-from base in the disk tier (fsdp.offload.params=disk) reads its NF4 codes "
              "from those files at every gather, which must then stay unchanged while training (false: a copy in "
              "the tier)"),
      boolean(FIELD(lora, replicate_adapters),
              "keep the adapters whole on every rank and all-reduce their gradients, instead of sharding them"),
      string(FIELD(lora, adapter_from),
             "a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from"),
  };
}

#undef FIELD
#undef MEMBER

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
