// fsdp-train's side of the plan: the library's plan (fsdp/plan.h) of a config, on this machine's
// budgets, and the memory levers' own figures, which the end-of-run report sets beside what it
// measured:
//  - activations: what one micro-batch's forward keeps for its backward (Note [Activation bytes]
//    in models/llama/shape.cpp), smaller with activation checkpointing, which keeps only each
//    checkpointed layer's output and rebuilds one layer's activations at a time in backward;
//  - accumulated gradients: with train.grad_accum_steps > 1, every unit's unreduced gradient
//    buffer (param_dtype, the whole model) lives from the first micro-batch to the last;
//  - the async save's snapshot: a host copy of this rank's params and optimizer state while a
//    checkpoint is written in the background.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "config.h"
#include "fsdp/options.h"
#include "fsdp/plan.h"
#include "llama.h"
#include "shape.h"

namespace train {

struct PlanInputs {
  llama::LlamaConfig model;
  at::ScalarType param_dtype = at::kFloat;
  int shard_size = 1;
  int64_t micro_batch = 0;  // samples per rank per micro-batch (data.batch_size_per_rank); 0: no activations
  int64_t seq_len = 0;
  int64_t checkpoint_every = 0;  // train.activation_checkpointing: 0 none, n every n-th layer
  int64_t grad_accum_steps = 1;
  fsdp::Accumulation accumulation = fsdp::Accumulation::kNoSync;  // train.accumulation
  int replicas = 1;                                               // fsdp.replicate
  int64_t trainable_params = -1;                                  // -1: every parameter (no LoRA)
  int64_t loss_chunk_tokens = 0;                                  // train.loss_chunk_tokens
  bool async_save = false;
  int state_element_bytes = 4;  // AdamW's moments: 4 (float32) or 2 (optim.state_dtype bfloat16)
};

// The levers' figures per rank, bytes.
struct MemoryPlan {
  int64_t num_params = 0;
  int64_t activations = 0;  // kept from one micro-batch's forward to its backward
  int64_t recompute = 0;    // checkpointing: one layer's activations rebuilt during backward
  int64_t checkpointed_layers = 0;
  int64_t accum_grads = 0;     // unreduced gradients kept across micro-batches
  int64_t partial_grads = 0;   // reduce-scattered sums awaiting the replicas' all-reduce
  int64_t async_snapshot = 0;  // host copy while a save is in flight
};

MemoryPlan plan_memory(const PlanInputs& in);

// Each lever's measured bytes (-1: not measured in this run).
struct MeasuredLevers {
  int64_t activations = -1;
  int64_t accum_grads = -1;
  int64_t partial_grads = -1;
  int64_t async_snapshot = -1;
};
// {"activations": {"plan": bytes, "measured": bytes, "error": (measured - plan) / plan}, ...} for
// each lever the plan predicts and the run measured.
nlohmann::json lever_report(const MemoryPlan& plan, const MeasuredLevers& measured);

// The run's request to the library's planner (fsdp/plan.h): the config's choices fixed, the budgets
// from train.budget (0: this machine's, below), `ranks_per_node` x `nodes` ranks.
fsdp::PlanRequest plan_request(const TrainConfig& cfg, int ranks_per_node, int nodes);
// The host budget of later plans in this process: the one the run was checked against before it
// allocated (after the load, the machine's available memory no longer includes the run's own).
void pin_host_budget(int64_t bytes);
// How this run loads its model and whether it saves: the plan's load and save phases.
void set_run_phases(fsdp::LoadKind load, bool saves);
// The plan of `cfg`'s run on the ranks the launcher's environment names (WORLD_SIZE,
// LOCAL_WORLD_SIZE; none: one rank).
fsdp::Plan plan_run(const TrainConfig& cfg);
// The model's shape for the planner: llama::plan_shape, with the lora section's adapters and
// frozen base when it is on, split as fsdp.split_root resolves for `req`.
fsdp::ModelShape plan_shape(const TrainConfig& cfg, const fsdp::PlanRequest& req);
// The request of this run's ranks (WORLD_SIZE, LOCAL_WORLD_SIZE; none: one rank).
fsdp::PlanRequest run_request(const TrainConfig& cfg);
// fsdp.split_root resolved: "auto" splits an untied head and embedding out of the root when the
// plan of `req` peaks lower that way by kSplitRootMinGain or more (the same on every rank: no
// budget enters the comparison).
inline constexpr int64_t kSplitRootMinGain = int64_t{16} << 20;
bool splits_root(const TrainConfig& cfg, fsdp::PlanRequest req);
// fsdp.vocab_parallel resolved: "auto" is on whenever the embedding and the head are frozen (a
// LoRA run without lm_head among its targets); "on" otherwise throws std::invalid_argument.
bool vocab_parallel_on(const TrainConfig& cfg);
// train.save_in_step resolved: "auto" is on when a master or optimizer state is in the disk tier
// (fsdp.offload.params or optimizer_state "disk") and saves are synchronous.
bool save_in_step_on(const TrainConfig& cfg);

// This machine: MemAvailable (/proc/meminfo), and the free bytes of the file system holding
// `path` (or its nearest existing parent). Throw std::runtime_error when they cannot be read.
int64_t host_available_bytes();
int64_t disk_free_bytes(const std::string& path);

// One line naming the levers in use: activation checkpointing, accumulation, async saves, loss
// scaling and the skip policy.
std::string levers_summary(const TrainConfig& cfg, int64_t global_batch);

}  // namespace train
