// The memory plan: model state by tier, the largest gathered unit, and the memory levers.
#include "memory_plan.h"

#include <algorithm>

#include "fsdp/errors.h"
#include "fsdp/lora.h"

#include <sys/statvfs.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "base/strings.h"

namespace train {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const int n = std::atoi(v);
  if (n < 1) throw std::invalid_argument(std::string(name) + "=" + v + " must be a positive integer");
  return n;
}

// The config key of each option the library's planner names (fsdp::PlanRequest::option_name).
std::string config_key(const std::string& option) {
  static const std::pair<const char*, const char*> kKeys[] = {
      {"FullyShardOptions::strategy", "fsdp.strategy"},
      {"OffloadPolicy::params", "fsdp.offload.params"},
      {"OffloadPolicy::grads", "fsdp.offload.grads"},
      {"OffloadPolicy::optimizer_state", "fsdp.offload.optimizer_state"},
      {"MixedPrecisionPolicy::reduce_dtype", "fsdp.reduce_dtype"},
      {"PlanRequest::checkpoint_every", "train.activation_checkpointing"},
      {"PlanRequest::micro_batch", "data.batch_size_per_rank"},
      {"grad_accum_steps", "train.grad_accum_steps"},
      {"PlanRequest::accumulation", "train.accumulation"},
      {"PlanRequest::keep_gathered", "train.keep_gathered"},
      {"PlanRequest::optimizer_state_dtype", "optim.state_dtype"},
      {"PlanRequest::reshard_after_forward_group", "fsdp.reshard_after_forward_group"},
      {"PlanRequest::replicate_adapters", "lora.replicate_adapters"},
  };
  for (const auto& [name, key] : kKeys) {
    if (option == name) return key;
  }
  return option;
}

}  // namespace

int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  throw std::runtime_error("cannot read MemAvailable from /proc/meminfo: set train.budget.host_bytes");
}

int64_t disk_free_bytes(const std::string& path) {
  std::string p = path.empty() ? "." : path;
  struct statvfs st {};
  while (::statvfs(p.c_str(), &st) != 0) {
    const auto slash = p.find_last_of('/');
    if (p == "/" || p == ".") throw std::runtime_error("cannot stat the file system of " + path);
    p = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
  }
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

namespace {
int64_t pinned_host_budget = 0;                   // pin_host_budget(); 0: read the machine each time
fsdp::LoadKind run_load = fsdp::LoadKind::kInit;  // set_run_phases()
bool run_saves = false;
}  // namespace

void pin_host_budget(int64_t bytes) { pinned_host_budget = bytes; }

void set_run_phases(fsdp::LoadKind load, bool saves) {
  run_load = load;
  run_saves = saves;
}

fsdp::PlanRequest plan_request(const TrainConfig& cfg, int ranks_per_node, int nodes) {
  fsdp::PlanRequest r;
  r.ranks_per_node = ranks_per_node;
  r.nodes = nodes;
  r.device = cfg.fsdp.on_cuda() ? c10::kCUDA : c10::kCPU;
  r.param_dtype = cfg.fsdp.param_dtype;
  r.reduce_dtype = cfg.fsdp.reduce_dtype;
  r.optimizer_state_tensors = 2;  // AdamW
  r.optimizer_state_dtype = cfg.optim.state_dtype;
  r.accumulation = cfg.train.accumulation;
  r.keep_gathered = cfg.train.keep_gathered;
  r.reshard_after_forward_group = static_cast<int>(cfg.fsdp.reshard_after_forward_group);
  r.replicate_adapters = cfg.lora.enabled && cfg.lora.replicate_adapters;
  r.option_name = config_key;
  r.seq_len = cfg.data.seq_len;
  r.batch_per_rank = cfg.data.batch_size_per_rank * cfg.train.grad_accum_steps;
  r.micro_batch = cfg.data.batch_size_per_rank;
  r.checkpoint_every = cfg.train.activation_checkpointing;
  r.strategy = cfg.fsdp.strategy;
  r.offload = cfg.fsdp.offload;
  r.prefetch_depth = static_cast<int>(cfg.fsdp.prefetch_depth);
  r.async_save = cfg.train.async_save;
  if (cfg.train.save_in_step != "auto" || cfg.train.async_save) r.save_in_step = save_in_step_on(cfg);
  r.load = run_load;
  r.saves = run_saves;
  r.save_frozen = !cfg.lora.enabled || cfg.lora.save_base;
  r.measured_process_bytes = fsdp::process_resident_bytes();  // first called before the job is joined
  // HYBRID_SHARD shards over world / fsdp.replicate ranks and replicates across fsdp.replicate rows:
  // the planner's nodes and ranks per node, wherever the ranks run.
  const int world = ranks_per_node * nodes;
  if (cfg.fsdp.strategy == fsdp::ShardingStrategy::kHybridShard && cfg.fsdp.replicate > 1 &&
      world % cfg.fsdp.replicate == 0) {
    r.ranks_per_node = world / cfg.fsdp.replicate;
    r.nodes = cfg.fsdp.replicate;
  }
  const int64_t local = ranks_per_node;
  r.budget.host_bytes = cfg.train.budget_host_bytes > 0 ? cfg.train.budget_host_bytes
                        : pinned_host_budget > 0        ? pinned_host_budget
                                                        : host_available_bytes() / local;
  r.budget.device_bytes = cfg.train.budget_device_bytes > 0 ? cfg.train.budget_device_bytes : int64_t{1} << 60;
  r.budget.disk_bytes =
      cfg.train.budget_disk_bytes > 0 ? cfg.train.budget_disk_bytes : disk_free_bytes(cfg.fsdp.offload.dir()) / local;
  return r;
}

namespace {

fsdp::ModelShape shape_of(const TrainConfig& cfg, bool split) {
  const int64_t chunk = cfg.train.loss_chunk_tokens;
  if (!cfg.lora.enabled) return llama::plan_shape(cfg.model, nullptr, chunk, split);
  const fsdp::LoraOptions lora = cfg.lora.options();
  try {
    return llama::plan_shape(cfg.model, &lora, chunk, split, vocab_parallel_on(cfg));
  } catch (const fsdp::ConfigError& e) {
    throw std::invalid_argument("config: lora.targets=" + nlohmann::json(cfg.lora.targets).dump() + ": " + e.what());
  }
}

}  // namespace

fsdp::PlanRequest run_request(const TrainConfig& cfg) {
  const int world = env_int("WORLD_SIZE", 1);
  const int local = env_int("LOCAL_WORLD_SIZE", world);
  if (world % local != 0) {
    throw std::invalid_argument("WORLD_SIZE " + std::to_string(world) + " is not a multiple of LOCAL_WORLD_SIZE " +
                                std::to_string(local));
  }
  return plan_request(cfg, local, world / local);
}

bool save_in_step_on(const TrainConfig& cfg) {
  if (cfg.train.save_in_step == "off" || cfg.train.async_save) return false;
  return cfg.train.save_in_step == "on" ||
         fsdp::save_in_step_pays(cfg.fsdp.offload.params(), cfg.fsdp.offload.optimizer_state(), false);
}

bool vocab_parallel_on(const TrainConfig& cfg) {
  const std::string& choice = cfg.fsdp.vocab_parallel;
  if (choice == "off") return false;
  bool frozen = false;
  if (cfg.lora.enabled) {
    // The adapted model itself decides, as the session's llama::shard_vocab_parallel will: a target
    // pattern may reach lm_head by a regular expression as well as by its name. On the meta device.
    llama::LlamaForCausalLM meta(cfg.model, at::kMeta);
    try {
      fsdp::lora(*meta, cfg.lora.options());
    } catch (const fsdp::ConfigError& e) {
      throw std::invalid_argument("config: lora.targets=" + nlohmann::json(cfg.lora.targets).dump() + ": " + e.what());
    }
    frozen = llama::can_shard_vocab_parallel(meta);
  }
  if (frozen) return true;
  if (choice == "auto") return false;
  throw std::invalid_argument(
      "config: fsdp.vocab_parallel=on: the embedding and the head must be frozen, as the base of a LoRA run "
      "(lora.enabled) whose lora.targets leave out lm_head; set it to auto or off");
}

bool splits_root(const TrainConfig& cfg, fsdp::PlanRequest req) {
  const std::string& choice = cfg.fsdp.split_root;
  if (choice == "off") return false;
  if (vocab_parallel_on(cfg)) {  // the tables are out of the root already, never gathered
    if (choice == "auto") return false;
    throw std::invalid_argument(
        "config: fsdp.split_root=on with vocab-parallel tables (fsdp.vocab_parallel, auto for a LoRA run): "
        "the embedding and the head are out of the root already; set fsdp.split_root to auto or off, or "
        "fsdp.vocab_parallel to off");
  }
  if (!llama::can_shard_embedding_and_head(cfg.model)) {
    if (choice == "auto") return false;
    throw std::invalid_argument(
        "config: fsdp.split_root=on: the model ties its head to its embedding "
        "(tie_word_embeddings), so the two are one tensor and stay in the root; set it to "
        "auto or off");
  }
  if (choice == "on") return true;
  // auto: the lower peak, on every rank alike (no budget, which each rank reads for itself, enters),
  // by kSplitRootMinGain or more. The split gathers the embedding and the head apart (one
  // all-gather more per step) and changes which ranks' shards a gradient element sums in; a gain
  // of 0.1 MiB on a small model decided it, and a setting that moves the peak by as little
  // (fsdp.reshard_after_forward_group) flipped it, and the losses' last bits with it. A share of
  // the peak would not do: with no budget a large model's peak is its whole state, of which the
  // root is a small part however much the split matters under the real budget.
  req.budget.host_bytes = req.budget.device_bytes = req.budget.disk_bytes = int64_t{1} << 60;
  const int64_t split = fsdp::plan(shape_of(cfg, true), req).device.total();
  const int64_t whole = fsdp::plan(shape_of(cfg, false), req).device.total();
  return whole - split >= kSplitRootMinGain;
}

fsdp::ModelShape plan_shape(const TrainConfig& cfg, const fsdp::PlanRequest& req) {
  return shape_of(cfg, splits_root(cfg, req));
}

fsdp::Plan plan_run(const TrainConfig& cfg) {
  const fsdp::PlanRequest req = run_request(cfg);
  fsdp::Plan p = fsdp::plan(plan_shape(cfg, req), req);
  if (cfg.fsdp.on_cuda() && cfg.train.budget_device_bytes <= 0) {
    p.assumptions.push_back("device memory not checked (train.budget.device_bytes 0)");
  }
  return p;
}

MemoryPlan plan_memory(const PlanInputs& in) {
  const auto& m = in.model;
  MemoryPlan p;
  p.num_params = llama::param_counts(m).total(m);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(in.param_dtype));
  if (in.micro_batch > 0 && in.seq_len > 0) {
    const int64_t L = m.num_hidden_layers, B = in.micro_batch, T = in.seq_len;
    const int64_t full = llama::layer_activation_bytes(m, B, T, in.param_dtype);
    const int64_t n = in.checkpoint_every;
    p.checkpointed_layers = n > 0 ? (L + n - 1) / n : 0;  // layers 0, n, 2n, ...
    // A checkpointed layer keeps only its output (its input is the previous layer's output).
    const int64_t kept = elem * B * T * m.hidden_size;
    p.activations = llama::root_activation_bytes(m, B, T, in.param_dtype, in.loss_chunk_tokens) +
                    (L - p.checkpointed_layers) * full + p.checkpointed_layers * kept;
    p.recompute = p.checkpointed_layers > 0 ? full : 0;
  }
  // No-sync accumulation keeps every unit's unsharded gradient buffer (param_dtype).
  // Only trainable parameters have gradients (a LoRA run: the adapters').
  const int64_t trainable = in.trainable_params >= 0 ? in.trainable_params : p.num_params;
  if (in.grad_accum_steps > 1 && in.accumulation == fsdp::Accumulation::kNoSync) p.accum_grads = elem * trainable;
  // Note [Accumulation without the all-reduce]: an fp32 partial sum of each trainable shard.
  if (in.grad_accum_steps > 1 && in.accumulation == fsdp::Accumulation::kReduceScatter && in.replicas > 1) {
    p.partial_grads = 4 * ((trainable + in.shard_size - 1) / in.shard_size);
  }
  // The snapshot copies this rank's fp32 params and AdamW's two moments (not the gradients).
  if (in.async_save)
    p.async_snapshot = (4 + 2 * in.state_element_bytes) * ((p.num_params + in.shard_size - 1) / in.shard_size);
  return p;
}

nlohmann::json lever_report(const MemoryPlan& plan, const MeasuredLevers& got) {
  nlohmann::json j = nlohmann::json::object();
  auto add = [&](const char* name, int64_t planned, int64_t measured) {
    if (planned <= 0 || measured < 0) return;
    j[name] = {{"plan", planned},
               {"measured", measured},
               {"error", static_cast<double>(measured - planned) / static_cast<double>(planned)}};
  };
  add("activations", plan.activations, got.activations);
  add("accumulated_gradients", plan.accum_grads, got.accum_grads);
  add("partial_gradient_sums", plan.partial_grads, got.partial_grads);
  add("async_snapshot", plan.async_snapshot, got.async_snapshot);
  return j;
}

std::string levers_summary(const TrainConfig& cfg, int64_t global_batch) {
  const auto& t = cfg.train;
  std::string s = "levers: activation checkpointing ";
  s += t.activation_checkpointing == 0   ? "off"
       : t.activation_checkpointing == 1 ? "every layer"
                                         : "every " + std::to_string(t.activation_checkpointing) + " layers";
  s += "; " + std::to_string(t.grad_accum_steps) + " micro-batch(es) of " +
       std::to_string(cfg.data.batch_size_per_rank) + " per rank per step (" + std::to_string(global_batch) +
       " samples per step)";
  s += std::string("; checkpoints ") +
       (t.async_save           ? "saved in the background"
        : save_in_step_on(cfg) ? "saved synchronously, written during the step before each (train.save_in_step)"
                               : "saved synchronously");
  s += cfg.fsdp.loss_scaling() ? "; dynamic loss scaling from " + nlohmann::json(cfg.fsdp.scaler.init_scale()).dump()
                               : std::string("; no loss scaling");
  const int64_t max_skips = cfg.fsdp.scaler.max_consecutive_skips();
  s += "; non-finite steps skipped" +
       (max_skips > 0 ? ", " + std::to_string(max_skips) + " in a row stop the run" : std::string(", never stopping"));
  return s;
}

}  // namespace train
