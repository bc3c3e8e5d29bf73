// fsdp-train's side of the planner: choices resolved once, the request, the plan and its check,
// the levers against the plan's items (run_plan.h).
#include "run_plan.h"

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>

#include "base/strings.h"
#include "fsdp/errors.h"
#include "lora_setup.h"
#include "metrics.h"
#include "shape.h"
#include "sysinfo/sysinfo.h"

namespace train {
namespace {

using fsdp::base::mib;

std::string percent(double fraction) { return format("%g%%", 100 * fraction); }

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

// A figure the system reports (fsdp::sysinfo), or `why` thrown where it reports none.
int64_t reported(int64_t bytes, const std::string& why) {
  if (bytes < 0) throw std::runtime_error(why);
  return bytes;
}

// The request without budgets: the config's choices, the ranks.
fsdp::PlanRequest request_of(const TrainConfig& cfg, const Resolved& choices, int ranks_per_node, int nodes) {
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
  // auto: the planner's own rule on the tiers it plans (fsdp-plan may choose them).
  if (cfg.train.save_in_step != Switch::kAuto || cfg.train.async_save) r.save_in_step = choices.save_in_step;
  r.save_frozen = !cfg.lora.enabled || cfg.lora.save_base;
  r.margin = cfg.train.budget_margin_pct / 100;
  r.measured_process_bytes = fsdp::process_resident_bytes();  // first called before the job is joined
  // HYBRID_SHARD shards over world / fsdp.replicate ranks and replicates across fsdp.replicate rows:
  // the planner's nodes and ranks per node, wherever the ranks run.
  const int world = ranks_per_node * nodes;
  if (cfg.fsdp.strategy == fsdp::ShardingStrategy::kHybridShard && cfg.fsdp.replicate > 1 &&
      world % cfg.fsdp.replicate == 0) {
    r.ranks_per_node = world / cfg.fsdp.replicate;
    r.nodes = cfg.fsdp.replicate;
  }
  return r;
}

bool vocab_parallel_of(const TrainConfig& cfg) {
  if (cfg.fsdp.vocab_parallel == Switch::kOff) return false;
  bool frozen = false;
  if (cfg.lora.enabled) {
    // The adapted model itself decides, as the session's llama::shard_vocab_parallel will: a target
    // pattern may reach lm_head by a regular expression as well as by its name. On the meta device.
    llama::LlamaForCausalLM meta(cfg.model, at::kMeta);
    apply_lora(meta, cfg.lora, cfg.train.seed);
    frozen = llama::can_shard_vocab_parallel(meta);
  }
  if (frozen || cfg.fsdp.vocab_parallel == Switch::kAuto) return frozen;
  throw std::invalid_argument(
      "config: fsdp.vocab_parallel=on: the embedding and the head must be frozen, as the base of a LoRA run "
      "(lora.enabled) whose lora.targets leave out lm_head; set it to auto or off");
}

// `choices` with vocab_parallel and save_in_step resolved.
bool split_root_of(const TrainConfig& cfg, Resolved choices, int ranks_per_node, int nodes) {
  const Switch choice = cfg.fsdp.split_root;
  if (choice == Switch::kOff) return false;
  if (choices.vocab_parallel) {  // the tables are out of the root already, never gathered
    if (choice == Switch::kAuto) return false;
    throw std::invalid_argument(
        "config: fsdp.split_root=on with vocab-parallel tables (fsdp.vocab_parallel, auto for a LoRA run): "
        "the embedding and the head are out of the root already; set fsdp.split_root to auto or off, or "
        "fsdp.vocab_parallel to off");
  }
  if (!llama::can_shard_embedding_and_head(cfg.model)) {
    if (choice == Switch::kAuto) return false;
    throw std::invalid_argument(
        "config: fsdp.split_root=on: the model ties its head to its embedding (tie_word_embeddings), so the two "
        "are one tensor and stay in the root; set it to auto or off");
  }
  if (choice == Switch::kOn) return true;
  // auto: the lower peak, on every rank alike (no budget, which each rank reads for itself, enters),
  // by kSplitRootMinGain or more. The split gathers the embedding and the head apart (one
  // all-gather more per step) and changes which ranks' shards a gradient element sums in; a gain
  // of 0.1 MiB on a small model decided it, and a setting that moves the peak by as little
  // (fsdp.reshard_after_forward_group) flipped it, and the losses' last bits with it. A share of
  // the peak would not do: with no budget a large model's peak is its whole state, of which the
  // root is a small part however much the split matters under the real budget.
  fsdp::PlanRequest req = request_of(cfg, choices, ranks_per_node, nodes);
  req.budget.host_bytes = req.budget.device_bytes = req.budget.disk_bytes = int64_t{1} << 60;
  choices.split_root = true;
  const int64_t split = fsdp::plan(plan_shape(cfg, choices), req).device.total();
  choices.split_root = false;
  const int64_t whole = fsdp::plan(plan_shape(cfg, choices), req).device.total();
  return whole - split >= kSplitRootMinGain;
}

// The bytes of the plan's step items (device and host, both moments of backward) whose names begin
// with one of `prefixes`.
int64_t planned(const fsdp::Plan& p, std::initializer_list<const char*> prefixes) {
  int64_t n = 0;
  for (const fsdp::PlanTier* t : {&p.device, &p.host}) {
    for (const auto* items : {&t->items, &t->at_backward_start, &t->at_backward_end}) {
      for (const auto& [name, bytes] : *items) {
        for (const char* prefix : prefixes) n += name.rfind(prefix, 0) == 0 ? bytes : 0;
      }
    }
  }
  return n;
}

}  // namespace

Resolved resolve(const TrainConfig& cfg, int ranks_per_node, int nodes) {
  Resolved r;
  r.vocab_parallel = vocab_parallel_of(cfg);
  r.save_in_step =
      cfg.train.save_in_step == Switch::kOn ||
      (cfg.train.save_in_step == Switch::kAuto &&
       fsdp::save_in_step_pays(cfg.fsdp.offload.params(), cfg.fsdp.offload.optimizer_state(), cfg.train.async_save));
  r.split_root = split_root_of(cfg, r, ranks_per_node, nodes);
  return r;
}

fsdp::PlanRequest plan_request(const TrainConfig& cfg, const Resolved& choices, int ranks_per_node, int nodes) {
  fsdp::PlanRequest r = request_of(cfg, choices, ranks_per_node, nodes);
  const int64_t local = ranks_per_node;
  const std::string dir = cfg.fsdp.offload.dir(), no_meminfo = "cannot read MemAvailable from /proc/meminfo";
  r.budget.host_bytes =
      cfg.train.budget_host_bytes > 0
          ? cfg.train.budget_host_bytes
          : reported(fsdp::sysinfo::host_memory().available, no_meminfo + ": set train.budget.host_bytes") / local;
  r.budget.device_bytes = cfg.train.budget_device_bytes > 0 ? cfg.train.budget_device_bytes : int64_t{1} << 60;
  r.budget.disk_bytes =
      cfg.train.budget_disk_bytes > 0
          ? cfg.train.budget_disk_bytes
          : reported(fsdp::sysinfo::free_disk_bytes(dir), "cannot stat the file system of " + dir) / local;
  return r;
}

fsdp::ModelShape plan_shape(const TrainConfig& cfg, const Resolved& choices) {
  const int64_t chunk = cfg.train.loss_chunk_tokens;
  if (!cfg.lora.enabled) return llama::plan_shape(cfg.model, nullptr, chunk, choices.split_root);
  const fsdp::LoraOptions lora = cfg.lora.options();
  try {
    return llama::plan_shape(cfg.model, &lora, chunk, choices.split_root, choices.vocab_parallel);
  } catch (const fsdp::ConfigError& e) {
    throw std::invalid_argument("config: lora.targets=" + nlohmann::json(cfg.lora.targets).dump() + ": " + e.what());
  }
}

RunPlan plan_run(const TrainConfig& cfg, fsdp::LoadKind load, bool saves, bool bnb_source) {
  const int world = env_int("WORLD_SIZE", 1);
  const int local = env_int("LOCAL_WORLD_SIZE", world);
  if (world % local != 0) {
    throw std::invalid_argument("WORLD_SIZE " + std::to_string(world) + " is not a multiple of LOCAL_WORLD_SIZE " +
                                std::to_string(local));
  }
  RunPlan run;
  run.resolved = resolve(cfg, local, world / local);
  try {
    run.request = plan_request(cfg, run.resolved, local, world / local);
    run.request.load = load;
    run.request.saves = saves;
    run.request.nf4_codes_in_place = bnb_source;
    run.plan = fsdp::plan(plan_shape(cfg, run.resolved), run.request);
  } catch (const std::exception& e) {
    if (cfg.train.check_budget) throw;  // unchecked: a config the planner cannot take still runs
    run.refused = e.what();
  }
  if (run.plan && cfg.fsdp.on_cuda() && cfg.train.budget_device_bytes <= 0) {
    run.plan->assumptions.push_back("device memory not checked (train.budget.device_bytes 0)");
  }
  return run;
}

void check_budget(const TrainConfig& cfg, const RunPlan& run) {
  if (!cfg.train.check_budget || !run.plan || run.plan->fits) return;
  const fsdp::Plan& p = *run.plan;
  const bool cpu = run.request.device == c10::kCPU;
  const int64_t budget = cpu ? run.request.budget.host_bytes : run.request.budget.device_bytes;
  std::string why = "the run does not fit this machine's budgets (train.budget): ";
  if (p.peak() > budget - p.margin_bytes) {
    why += "its plan peaks at " + mib(p.peak(), 1) + " per rank (in the " + p.peak_phase() + "), over the " +
           (cpu ? "host" : "device") + " budget of " + mib(budget, 1) + " less the margin of " +
           percent(run.request.margin) + " held free (" + mib(p.margin_bytes, 1) +
           ", train.budget.margin_pct): " + mib(budget - p.margin_bytes, 1) + ". ";
  }
  throw std::invalid_argument(why + p.shortfall +
                              " fsdp-train --plan prints the whole plan; train.budget.check=false runs it anyway.");
}

std::string plan_summary(const RunPlan& run) {
  const fsdp::Plan& plan = *run.plan;
  auto mb = [](int64_t bytes) { return mib(bytes, 1); };
  std::string line = "plan per rank for the training step: " + std::string(plan.host.items.empty() ? "" : "device ") +
                     "memory " + mb(plan.device.total());
  if (!plan.host.items.empty()) line += ", host memory " + mb(plan.host.total());
  if (!plan.disk.items.empty()) line += ", disk " + mb(plan.disk.total());
  line += "; " + fsdp::base::first_line(plan.to_string());
  line += "; the load (" + std::string(fsdp::load_kind_name(plan.load_kind)) + ") " + mb(plan.load.total());
  if (!plan.save.items.empty()) line += ", a save " + mb(plan.save.total());
  return line + "; peak " + mb(plan.peak()) + " in the " + plan.peak_phase() + "; margin held free " +
         mb(plan.margin_bytes) + " (" + percent(run.request.margin) + ", train.budget.margin_pct)";
}

nlohmann::json lever_report(const fsdp::Plan& plan, const MeasuredLevers& got) {
  nlohmann::json j = nlohmann::json::object();
  auto add = [&](const char* name, int64_t planned, int64_t measured) {
    if (planned <= 0 || measured < 0) return;
    j[name] = {{"plan", planned},
               {"measured", measured},
               {"error", static_cast<double>(measured - planned) / static_cast<double>(planned)}};
  };
  add("activations", planned(plan, {"activations kept from forward"}), got.activations);
  // Across micro-batches every gradient buffer is alive: the step's own and the unreduced rest.
  const int64_t unreduced = planned(plan, {"unreduced gradients across micro-batches"});
  add("accumulated_gradients",
      unreduced > 0 ? unreduced + planned(plan, {"gradient buffers (", "a second layer's gradient buffer"}) : 0,
      got.accum_grads);
  add("partial_gradient_sums", planned(plan, {"partial gradient sums"}), got.partial_grads);
  add("async_snapshot", planned(plan, {"async save's snapshot"}), got.async_snapshot);
  return j;
}

std::string levers_summary(const TrainConfig& cfg, const Resolved& choices) {
  const auto& t = cfg.train;
  std::string s =
      std::string("levers: checkpoints ") +
      (t.async_save           ? "saved in the background"
       : choices.save_in_step ? "saved synchronously, written during the step before each (train.save_in_step)"
                              : "saved synchronously");
  s += cfg.fsdp.loss_scaling() ? "; dynamic loss scaling from " + nlohmann::json(cfg.fsdp.scaler.init_scale()).dump()
                               : std::string("; no loss scaling");
  const int64_t max_skips = cfg.fsdp.scaler.max_consecutive_skips();
  s += "; non-finite steps skipped" +
       (max_skips > 0 ? ", " + std::to_string(max_skips) + " in a row stop the run" : std::string(", never stopping"));
  return s;
}

}  // namespace train
