// The planner: what a run of a model will hold in each tier per rank, what it will move per step,
// and, from per-rank budgets, the choices that make it fit (sharding strategy, the offload tier of
// each sharded state, activation checkpointing, the micro-batch). Arithmetic only: it allocates
// nothing, so it runs before a model exists (on a meta-device model or a model's shape from its
// config) and on a machine without the devices it plans for.
//
//   auto shape = fsdp::model_shape(*model, [](const std::string& name, torch::nn::Module&) {
//     return name.rfind("layers.", 0) == 0 && name.find('.', 7) == std::string::npos; });
//   fsdp::PlanRequest req;
//   req.ranks_per_node = 8;
//   req.device = at::kCUDA;
//   req.budget = {24LL << 30, 64LL << 30, 1LL << 40};  // device, host, disk per rank
//   fsdp::Plan plan = fsdp::plan(shape, req);
//   if (!plan.fits) throw std::runtime_error(plan.shortfall);
//
// Every figure is per rank. What the planner assumes (the process's own memory, the allocator's
// slack, what an activation-less unit keeps) is listed in Plan::assumptions and printed with it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <map>
#include <memory>
#include <vector>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "fsdp/offload_io.h"
#include "fsdp/options.h"

namespace fsdp {

// One unit (a module that fully_shard wraps, or the root's own parameters), in forward order.
struct UnitShape {
  std::string name;
  int64_t trainable_numel = 0;
  int64_t frozen_numel = 0;
  // How the frozen elements are stored (FullyShardOptions::frozen_storage), by storage; empty:
  // all of them in the compute dtype (the default). The counts add up to frozen_numel.
  std::map<FrozenStorage, int64_t> frozen_by_storage;
  // Bytes autograd keeps from this unit's forward to its backward for `batch` samples of
  // `seq_len` tokens at compute dtype `dtype`; `checkpointed`: the unit runs under activation
  // checkpointing (it keeps its input only). Unset: nothing kept (an assumption the plan states).
  std::function<int64_t(int64_t batch, int64_t seq_len, at::ScalarType dtype, bool checkpointed)> activations;
  // Bytes alive at this unit's peak inside its backward beyond what its forward kept (the
  // gradients of its activations), same arguments; unset: as large as `activations` uncheckpointed.
  std::function<int64_t(int64_t batch, int64_t seq_len, at::ScalarType dtype)> backward_peak;
  int64_t largest_param_numel = 0;  // its largest parameter (0: numel())
  bool is_root = false;             // the root's own parameters (embedding, head): kept from forward to backward
  bool checkpointable = true;       // activation checkpointing may apply to it (not the root)
  // A vocab-parallel table (FullyShardOptions::vocab_parallel): never gathered, no backward of its
  // own; only its shards count (the transient of the loss computed on them is the model's, in
  // the root's backward_peak).
  bool vocab_parallel = false;
  int64_t numel() const { return trainable_numel + frozen_numel; }
};

struct ModelShape {
  std::string name;  // e.g. the family and size, for the printout
  std::vector<UnitShape> units;
  int64_t numel() const;
  int64_t trainable_numel() const;
};

// The shape of `model` (any device, meta included): every submodule for which `is_unit(name,
// module)` holds becomes a unit (outermost first; nested matches belong to it), the rest of the
// parameters the root's unit. No activations: set UnitShape::activations for a model you know.
// `frozen_storage`: how frozen parameters will be stored (null: the compute dtype), as given to
// fully_shard (a LoRA model: LoraModel::frozen_storage()).
ModelShape model_shape(torch::nn::Module& model,
                       const std::function<bool(const std::string& name, torch::nn::Module& module)>& is_unit,
                       const FrozenStorageFn& frozen_storage = nullptr);

// A unit's activations measured by running one copy of it: fsdp::measure_activations (fsdp/measure.h).

struct PlanBudget {
  int64_t device_bytes = 0;  // per rank: the accelerator's memory (on CPU runs: RAM, see host)
  int64_t host_bytes = 0;    // per rank: host RAM (node RAM / ranks per node)
  int64_t disk_bytes = 0;    // per rank: free space for the disk tier under its directory
};

// How the micro-batches of a step accumulate their gradients (when grad_accum_steps > 1).
enum class Accumulation {
  // Unreduced until the last micro-batch (FSDPModule::set_requires_gradient_sync(false)): no
  // traffic until then, but every unit's unsharded gradient stays alive between micro-batches.
  kNoSync,
  // Each micro-batch reduce-scattered; under hybrid sharding the replicas' all-reduce only on the
  // last (FSDPModule::set_requires_all_reduce(false)): an fp32 partial-sum shard per trainable
  // flat param meanwhile.
  kReduceScatter,
  // Each micro-batch reduced in full (reduce-scatter and all-reduce).
  kReduce,
};
const char* accumulation_name(Accumulation a);             // "no_sync", "reduce_scatter", "reduce"
Accumulation parse_accumulation(const std::string& name);  // throws ConfigError naming it

// How a run's model gets its values: initialised shard by shard (FullyShardOptions::init), imported
// from foreign weights (import_weights), or loaded from a checkpoint with its optimizer state.
enum class LoadKind { kInit, kImport, kResume };
const char* load_kind_name(LoadKind k);             // "init", "import", "resume"
LoadKind parse_load_kind(const std::string& name);  // throws ConfigError naming it

// The margin fsdp's programs hold free by default (fsdp-plan --margin, fsdp-train's
// train.budget.margin_pct; PlanRequest::margin): a tenth of the budget, for what the plan does not
// count.
inline constexpr double kDefaultMargin = 0.10;

// fsdp-ckpt export's window: at most this many bytes of a tensor's fp32 values at a time (its rows
// read, converted and written in chunks of this size).
constexpr int64_t kExportChunkBytes = int64_t{64} << 20;

struct PlanRequest {
  int ranks_per_node = 1;
  int nodes = 1;
  c10::DeviceType device = c10::kCPU;        // on kCPU the device's memory is the host's (budget.host_bytes)
  at::ScalarType param_dtype = at::kFloat;   // compute (the gathered params' dtype)
  at::ScalarType reduce_dtype = at::kFloat;  // gradient reduction
  int optimizer_state_tensors = 2;           // state tensors per trainable parameter (AdamW: 2)
  // Their dtype (AdamWOptions::state_dtype): fp32, or bf16, which the disk tier does not hold.
  at::ScalarType optimizer_state_dtype = at::kFloat;
  int64_t seq_len = 0;
  int64_t batch_per_rank = 1;  // samples per rank per optimizer step (micro-batch x accumulation)
  Accumulation accumulation = Accumulation::kNoSync;
  int prefetch_depth = 1;
  // The process without a model (libraries, communicator, threads); on CUDA the context's device
  // memory. Defaults are this project's measured figures (the printout says which).
  std::optional<int64_t> process_host_bytes, process_device_bytes;
  // On the CPU, unless process_host_bytes is given: the planning process's own resident size
  // before it joins the job (process_resident_bytes()); the process item is it and what joining
  // adds (Note [The process measured by the process]). Unset: the constant default.
  std::optional<int64_t> measured_process_bytes;
  PlanBudget budget;
  // The fraction of the device's memory (on CPU runs the host's) held free when choosing, for what
  // the plan does not count (the allocator's slack and fragmentation, the data pipeline): a plan
  // fits when its device total is within budget x (1 - margin). In [0, 0.9].
  double margin = 0;
  // Choices fixed by the caller (a config's); unset ones the planner makes.
  std::optional<ShardingStrategy> strategy;
  std::optional<OffloadPolicy> offload;     // tiers (and the disk tier's memory budget)
  std::optional<int64_t> checkpoint_every;  // 0 none, n: every n-th checkpointable unit
  std::optional<int64_t> micro_batch;       // samples per rank per micro-batch
  // Every unit keeps its gathered parameters across the micro-batches of a step
  // (FSDPModule::set_reshard_after_forward/_backward(false) on all but the last): one all-gather per
  // unit per step, every unit gathered at once. Unset: chosen when there are several micro-batches
  // and it fits.
  std::optional<bool> keep_gathered;
  // FullyShardOptions::reshard_after_forward_group on every unit but the root (0: off): each keeps
  // 1/group of its params in the compute dtype from forward to backward, whose all-gather runs
  // within the group.
  int reshard_after_forward_group = 0;
  // FullyShardOptions::replicate_params for the trainable parameters of every unit that also holds
  // frozen ones (LoRA's adapters): whole on every rank, their gradients all-reduced over every rank.
  bool replicate_adapters = false;
  bool async_save = false;  // a host snapshot of params and state while saving
  // Saves written during the optimizer step before them (checkpoint::SaveInStep): that step holds
  // a checkpoint writer per file (the model's and each optimizer state's). Unset: as
  // save_in_step_pays says for the plan's tiers.
  std::optional<bool> save_in_step;
  // The phases around the steps (Note [The load and the save]): how the model gets its values, and
  // whether the run saves checkpoints, with the frozen parameters (SaveOptions::frozen_params) or not.
  LoadKind load = LoadKind::kInit;
  bool saves = false;
  bool save_frozen = true;
  // An NF4 frozen base imported from a bitsandbytes 4-bit checkpoint with its codes read in place
  // (ImportOptions::codes_in_place): in the disk tier, its codes take no disk (still read each step).
  bool nf4_codes_in_place = false;
  // How the plan names an option in its settings and its shortfall. The planner speaks in library
  // option names ("FullyShardOptions::strategy", "OffloadPolicy::params", "OffloadPolicy::grads",
  // "OffloadPolicy::optimizer_state", "MixedPrecisionPolicy::reduce_dtype",
  // "PlanRequest::checkpoint_every", "PlanRequest::micro_batch", "grad_accum_steps"); a program with
  // its own configuration (fsdp-train, fsdp-plan) translates them into its keys here. Unset: as is.
  std::function<std::string(const std::string& option)> option_name;
};

// Whether a save written during the optimizer step (checkpoint::SaveInStep) is worth its writers:
// a master or optimizer state in the disk tier, which a save after the step would read back, and
// synchronous saves (an async save snapshots instead). PlanRequest::save_in_step's default.
bool save_in_step_pays(OffloadTier params, OffloadTier optimizer_state, bool async_save);

// Bytes per rank in one place, item by item. The peak of a training step comes at one of two
// moments that do not overlap: the start of backward (every activation alive, the loss's
// gradients, the head's gradient) or its end (the activations freed, the root's reduction in
// flight). Items alive at both are in `items`; the total takes the larger moment.
struct PlanTier {
  enum Moment { kAlways, kBackwardStart, kBackwardEnd };
  std::vector<std::pair<std::string, int64_t>> items, at_backward_start, at_backward_end;
  int64_t total() const;
  void add(std::string name, int64_t bytes, Moment when = kAlways);
};

struct Plan {
  bool fits = false;
  std::string shortfall;  // when !fits: what is short, by how many bytes, and the lever that would fix it
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_size = 1;  // ranks one parameter is sharded over
  OffloadTier params = OffloadTier::kNone, grads = OffloadTier::kNone, optimizer_state = OffloadTier::kNone;
  int64_t disk_memory_budget = 0;  // the disk tier's mapped window (OffloadPolicy::memory_budget_bytes)
  int64_t margin_bytes = 0;        // of the device's memory, held free (PlanRequest::margin)
  int64_t checkpoint_every = 0;
  int64_t micro_batch = 0, grad_accum_steps = 1;
  bool keep_gathered = false;  // PlanRequest::keep_gathered, as chosen
  bool save_in_step = false;   // PlanRequest::save_in_step, as resolved (false when the run saves nothing)
  // Peak bytes per rank: device memory (on CPU runs the process's RAM, which is also `host`), host
  // RAM, and disk-tier files.
  PlanTier device, host, disk;
  // The load and the save (Note [The load and the save]), in the device tier's memory (on CPU runs
  // the process's RAM); `save` is empty when the run saves nothing. fits counts the largest phase.
  PlanTier load, save;
  // fsdp-ckpt export (a Hugging Face directory, a merged LoRA model) of this model's checkpoint:
  // one process on the machine, not a rank, so not in peak(). It converts each tensor a chunk of
  // rows at a time (kExportChunkBytes of fp32 values at most).
  PlanTier exporting;
  // fsdp-ckpt export of a LoRA run's adapters alone (a PEFT adapter directory): one process that
  // converts no base rows, so the process and one adapter at a time. Empty without adapters.
  PlanTier exporting_adapters;
  LoadKind load_kind = LoadKind::kInit;  // PlanRequest::load, for the printout
  int64_t peak() const;                  // the largest of device.total(), load.total(), save.total()
  const char* peak_phase() const;        // "step", "load" or "save": where peak() comes from
  // Per rank per step: bytes each rank sends in all-gathers and in reductions, and the disk tier's I/O.
  int64_t all_gather_bytes = 0, reduce_bytes = 0;
  // Of all_gather_bytes, what backward's gathers send inside groups of
  // PlanRequest::reshard_after_forward_group (the rest crosses the whole shard group).
  int64_t group_all_gather_bytes = 0;
  int64_t gathers_per_step = 0;  // all-gathers of units per micro-batch (per step with keep_gathered)
  OffloadIo io_per_step;
  std::vector<std::string> assumptions;
  // The settings this plan stands for, "NAME=VALUE" with NAME from PlanRequest::option_name, e.g.
  // "OffloadPolicy::optimizer_state=disk".
  std::vector<std::string> settings;
  std::string to_string() const;
};

// The plan for `shape` under `request`: fixed choices are kept, the others chosen fastest first
// (no offload before the host tier before the disk tier; no checkpointing before checkpointing;
// the largest micro-batch). When nothing fits, the plan of the cheapest choice with `fits` false
// and the shortfall filled. Throws ConfigError on a malformed request (no ranks, a negative budget,
// a margin outside [0, 0.9]) and on a shape or request whose bytes overflow 64 bits.
Plan plan(const ModelShape& shape, const PlanRequest& request);

// This process's resident set size (/proc/self/status VmRSS) at its first call; every later call
// returns that figure (0 where the kernel has none). A program calls it first when it plans, its
// libraries mapped, before it joins the job: PlanRequest::measured_process_bytes.
int64_t process_resident_bytes();

}  // namespace fsdp
