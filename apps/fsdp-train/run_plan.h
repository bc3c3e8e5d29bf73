// fsdp-train's side of the library's planner (fsdp/plan.h): the config's "auto" keys resolved once,
// the request a config makes on a machine's budgets, the run's plan with its budget check, and the
// memory levers measured against the plan's own items. fsdp-plan plans an fsdp-train config
// through the same functions (apps/fsdp-plan).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "config.h"
#include "fsdp/plan.h"

namespace train {

// The config's "auto" / "on" / "off" keys (Switch) as a run on `ranks_per_node` x `nodes` ranks
// does them, resolved once by resolve(): the session, the loop, the request and the reports read
// these, never the keys.
struct Resolved {
  // fsdp.vocab_parallel: auto is on whenever the embedding and the head are frozen (a LoRA run
  // without lm_head among its targets, as the adapted model on the meta device says).
  bool vocab_parallel = false;
  // fsdp.split_root: auto splits an untied head and embedding out of the root when the plan peaks
  // lower that way by kSplitRootMinGain or more (the same on every rank: no budget enters).
  bool split_root = false;
  // train.save_in_step: auto is on when a master or optimizer state is in the disk tier
  // (fsdp::save_in_step_pays) and saves are synchronous.
  bool save_in_step = false;
};
inline constexpr int64_t kSplitRootMinGain = int64_t{16} << 20;
// Throws std::invalid_argument naming the key when the config asks for what it cannot have
// (vocab_parallel or split_root "on" where they do not apply).
Resolved resolve(const TrainConfig& cfg, int ranks_per_node, int nodes);

// The request of `cfg`'s run (its choices fixed as `choices` resolve them) on `ranks_per_node` x
// `nodes` ranks; budgets from train.budget (0: this machine's, read now), the margin
// train.budget.margin_pct.
fsdp::PlanRequest plan_request(const TrainConfig& cfg, const Resolved& choices, int ranks_per_node, int nodes);
// The model's shape for the planner: llama::plan_shape with the lora section's adapters and frozen
// base when it is on, the tables as `choices` place them.
fsdp::ModelShape plan_shape(const TrainConfig& cfg, const Resolved& choices);

// What fsdp-train decides before the job joins, once: the choices and the plan of the run on the
// ranks the launcher's environment names (WORLD_SIZE, LOCAL_WORLD_SIZE; none: one rank), with its
// load and whether it saves (the plan's phases). The budget check, --plan and the reports read it.
struct RunPlan {
  Resolved resolved;
  fsdp::PlanRequest request;
  std::optional<fsdp::Plan> plan;  // none: train.budget.check false and the planner refused the config
  std::string refused;             // then, why
};
// `bnb_source`: the import reads a bitsandbytes 4-bit checkpoint, whose NF4 codes an NF4 base in
// the disk tier reads in place (fsdp::PlanRequest::nf4_codes_in_place).
RunPlan plan_run(const TrainConfig& cfg, fsdp::LoadKind load, bool saves, bool bnb_source = false);
// Throws std::invalid_argument when train.budget.check is on and the plan does not fit: the budget,
// the plan's peak and the margin held free by name, then what is short.
void check_budget(const TrainConfig& cfg, const RunPlan& run);
// One line: the plan's totals per rank, its choices, its phases, its peak and the margin kept.
std::string plan_summary(const RunPlan& run);

// Each lever's bytes measured on one rank (-1: not measured in this run).
struct MeasuredLevers {
  int64_t activations = -1;     // kept from one micro-batch's forward to its backward
  int64_t accum_grads = -1;     // gradient buffers alive across the micro-batches of a step
  int64_t partial_grads = -1;   // reduce-scattered sums awaiting the replicas' all-reduce
  int64_t async_snapshot = -1;  // an async save's host copy
};
// {"activations": {"plan": bytes, "measured": bytes, "error": (measured - plan) / plan}, ...} for
// each lever the plan counts and the run measured, the plan's bytes summed from its items.
nlohmann::json lever_report(const fsdp::Plan& plan, const MeasuredLevers& measured);

// One line naming the levers in use that the plan does not print (its first line gives activation
// checkpointing and the micro-batches): how checkpoints are saved, loss scaling, the skip policy.
std::string levers_summary(const TrainConfig& cfg, const Resolved& choices);

}  // namespace train
