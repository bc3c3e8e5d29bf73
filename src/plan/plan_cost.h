// The planner's arithmetic for one set of choices (plan_cost.cpp); the search over choices and the
// shortfall are in plan.cpp.
// Note [The planner's arithmetic]
// What one set of choices costs each rank, from the units' sizes only. The items follow what the
// runtime allocates (docs/ARCHITECTURE.md, "A unit's life"):
//  - the process itself (libraries, the communicator, threads): a measured constant, and on the
//    CPU what a step's compute libraries map (Note [The compute libraries' first use]);
//  - sharded states: each unit's trainable and frozen parameters are flat params padded to the
//    shard size; the fp32 master (4 bytes per element), the fp32 gradient shard and the optimizer's
//    fp32 state tensors, each in its tier. With only the optimizer state offloaded, the master
//    follows it and the device keeps a working copy in the compute dtype. A frozen parameter is
//    kept in its stored form (Note [Frozen storage]: the compute dtype by default, 2 bytes for
//    bf16, 1 + 4/64 for int8, 0.5 + 4/64 for NF4) on the device, and is gathered in that form;
//  - gathered parameters, in the compute dtype, at the moment most are alive: the units that keep
//    theirs from forward to backward (the root, the last unit) once they have run, plus the unit
//    computing and the `prefetch_depth` after it, in forward or in backward (gathered_peak); the
//    layers' part of it at the start of backward only (Note [Two moments of backward]);
//  - gradient buffers: the root's lives through the whole backward (its head's gradient comes
//    first, its embedding's last), one layer's is being filled and one (at the start) reduced;
//  - on the CPU, freed blocks kept for reuse (Note [Reusing freed host buffers]): two of a
//    layer's trainable size (a gradient buffer is freed when its reduction is collected, after the
//    next gathers have taken what they needed, so blocks that size wait beside the live ones) and
//    under activation checkpointing one of a layer's largest frozen part in the compute dtype (a
//    QLoRA layer's decoded base, kept for the next gather of its size: +376 MiB measured at
//    Llama-3.1-8B, where dropping it cost 41% of a step in page faults; without checkpointing the
//    first backward unit's gradient buffer frees it before the peak: bench/results/plan-accuracy.md);
//  - the disk tier's mapped window (its memory budget), which on the CPU counts in the RSS;
//  - with accumulation, every unit's unreduced gradient buffer; with an async save, the snapshot.
// Then the larger of two moments that do not overlap. At the start of backward: every unit's
// activations, the head's gradient as autograd makes it, before its hook copies it in, and the
// larger of the loss's backward and the first layer's (with checkpointing, its activations
// rebuilt; Note [Two moments of backward]). At the end: the activations are freed, the embedding's
// gradient waits for its copy, and the root's reduction is in flight until the optimizer collects
// it (its gradient cast to reduce_dtype, and the reduced shard). Measured on this machine, 2 ranks,
// bf16 compute, the total is within 10% of each rank's peak RSS (tests/e2e/plan_e2e_test.sh,
// bench/results/scale-*.md). Per step, each rank sends (N - 1) shards of every unit it gathers (a
// ring) and of every gradient it reduces; the disk tier reads and writes what it holds once per
// step, plus a disk-tier master's reads for the gathers.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "fsdp/plan.h"

namespace fsdp::planning {

// One candidate: every choice made.
struct Choices {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  OffloadTier params = OffloadTier::kNone, grads = OffloadTier::kNone, optimizer_state = OffloadTier::kNone;
  int64_t disk_memory_budget = 0;
  int64_t checkpoint_every = 0;
  int64_t micro_batch = 1;
  bool keep_gathered = false;  // PlanRequest::keep_gathered
};

// The process's own memory when the request leaves it unset (this project's measured figures).
int64_t default_process_host_bytes(c10::DeviceType device);
int64_t default_process_device_bytes(c10::DeviceType device);
// The plan's process item in host memory: given, measured (Note [The process measured by the
// process], plan.cpp), or the default.
int64_t process_host_bytes(const PlanRequest& req);
// What a step maps on the CPU beyond the process (Note [The compute libraries' first use], plan_cost.cpp).
int64_t compute_libraries(const PlanRequest& req);
constexpr int64_t kJoinBytes = int64_t{16} << 20;  // what joining the job adds to a process measured before it

// The ranks one parameter is sharded over under `strategy`.
int shard_size_of(ShardingStrategy strategy, const PlanRequest& req);

// a + b, or a ConfigError naming `what` when the sum leaves 64 bits (a shape or request too large to
// plan); a negative `b` (a figure that wrapped around) is refused the same way.
int64_t add_bytes(int64_t a, int64_t b, const std::string& what);

// What the load and the save hold (Note [The load and the save], phases.cpp), per rank, in the
// device tier's memory.
struct PhaseInputs {
  int64_t process = 0;               // the process's own memory
  int64_t loaded = 0;                // the sharded states once loaded
  int64_t at_rest = 0;               // the step's sharded states
  int64_t stored_largest = 0;        // the largest stored frozen shard's fp32 values
  int64_t disk_read_chunk = 0;       // bytes of a chunk a save reads from the disk tier (0: nothing there)
  bool master_on_disk = false;       // a master in the disk tier (an import writes it in chunks)
  bool state_on_disk = false;        // any state in the disk tier (a resume writes it in chunks)
  bool state_via_host = false;       // a state on a device or in bf16 (a resume reads it through fp32 host memory)
  int64_t working_cast_element = 0;  // bytes per element of a working copy not in fp32 (0: none)
  int64_t snapshot = 0;              // an async save's
  int64_t largest_param = 0;         // elements of the model's largest parameter (the export's largest chunk)
  int64_t largest_trainable = 0;     // of its largest trainable one
  bool has_frozen = false;           // frozen parameters beside trainable ones (a LoRA run: a merged export)
};
void add_phases(const PlanRequest& req, const PhaseInputs& in, Plan& p);

// The repeated units (the layers): the checkpointable ones when the model has any, beside which a
// unit of its own for an embedding or a head is no layer.
std::vector<bool> layers_of(const ModelShape& shape);

constexpr int64_t kHeapBlockLimit = int64_t{4}
                                    << 20;  // the mmap threshold tune_host_malloc sets (base/host_malloc.cpp)

// Activations kept over the whole model, and the backward's transients: the largest extra of the
// units that are not layers (the loss's, in the root's backward before any layer's), that of the
// layers', and the largest checkpointed unit's activations rebuilt in its backward.
struct ActivationBytes {
  int64_t kept = 0, first_extra = 0, layer_extra = 0, rebuilt = 0;
  int64_t heap_slack = 0;  // Note [The heap's slack] (backward_start.cpp)
  int64_t largest_extra() const { return std::max(first_extra, layer_extra); }
};
ActivationBytes activations(const ModelShape& shape, const PlanRequest& req, const Choices& c);

// What the layers' gathered params add beyond the units that are not layers, in the loss's
// backward and at their peak (a layer's backward).
struct LayersGathered {
  int64_t at_peak = 0, at_loss = 0;  // beyond the units that are not layers
  std::string what;                  // the units at the peak
};
// The start of backward's larger moment, in the device tier (Note [Two moments of backward]).
void add_backward_start(const LayersGathered& g, const ActivationBytes& a, Plan& p);

// Every figure of `choices` for `shape`; `fits` against the request's budgets, without a shortfall text.
Plan cost(const ModelShape& shape, const PlanRequest& req, const Choices& choices);

}  // namespace fsdp::planning
