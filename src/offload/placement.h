// The placement rulebook: where one flat param's sharded states live under its unit's
// OffloadPolicy, what they hold in each tier, and what a training step moves between the tiers.
// The runtime places states and predicts its I/O by these rules (shard/unit_init.cpp, Residency,
// offload_plan in optim/memory.cpp), and the planner costs a configuration by the same ones (src/plan), so
// a plan describes the run it plans. See Note [Placement rules] in placement.cpp.
#pragma once

#include <vector>

#include <cstdint>
#include <string>

#include "fsdp/offload_policy.h"

namespace fsdp::offload {

// What kind of flat param is being placed.
struct FlatParamKind {
  bool trainable = true;
  bool stored_frozen = false;  // frozen and kept in a stored form (bf16, int8, NF4), no fp32 master
};

// The tier of each sharded state of one flat param.
struct StateTiers {
  OffloadTier master = OffloadTier::kNone;  // the master shard (a frozen one's stored form)
  OffloadTier grads = OffloadTier::kNone;
  OffloadTier optimizer_state = OffloadTier::kNone;
  bool working_copy = false;  // the master follows its state: the device keeps a working copy
};

// ZeRO-Offload: params and grads with the device, the optimizer state offloaded; the fp32 master
// then lives (and is stepped) with its state.
bool master_follows_state(OffloadTier params, OffloadTier grads, OffloadTier optimizer_state);
inline bool master_follows_state(const OffloadPolicy& p) {
  return master_follows_state(p.params(), p.grads(), p.optimizer_state());
}
// A unit on a device offloads all of its states, or its optimizer state alone, or none.
bool allowed_on_device(const OffloadPolicy& policy, bool device_is_cpu);
// Throws ConfigError naming `unit`, its tiers and the fix unless allowed_on_device.
void check_allowed_on_device(const OffloadPolicy& policy, const std::string& unit, bool device_is_cpu,
                             const std::string& device);
// Whether a run whose units use `policy` needs host staging (the host tier, or any tier on a device).
bool needs_stager(const OffloadPolicy& policy, bool device_is_cpu);
// The tiers of a flat param of `kind` under `policy`; `has_stager`: the run has host staging.
StateTiers place(const OffloadPolicy& policy, FlatParamKind kind, bool has_stager);

// Bytes a flat param's sharded states hold in each tier, indexed by tier_index().
struct TierBytes {
  int64_t bytes[3] = {0, 0, 0};
  int64_t& operator[](OffloadTier t) { return bytes[tier_index(t)]; }
  int64_t operator[](OffloadTier t) const { return bytes[tier_index(t)]; }
  static int tier_index(OffloadTier t) { return t == OffloadTier::kNone ? 0 : t == OffloadTier::kHost ? 1 : 2; }
};

// One flat param's sizes and the step's shape around it.
struct FlatParamIo {
  int64_t master_bytes = 0;     // the master shard as kept (fp32, or a frozen shard's stored form)
  int64_t compute_bytes = 0;    // the shard in the compute dtype (the gather's input, the working copy)
  int64_t reduced_bytes = 0;    // the reduced gradient shard in reduce_dtype
  int state_tensors = 2;        // optimizer state tensors per element (AdamW: 2)
  int state_element_bytes = 4;  // their element size: 4 (fp32), or 2 (AdamW's moments in bf16)
  int gathers = 2;              // all-gathers per step: 2, or 1 when the unit keeps its params for backward
  bool forward_kept = true;     // a disk-tier master's forward read is kept for the backward gather
  bool step_in_backward = false;
  bool device_is_cpu = true;
  bool gathers_at_all = true;  // sharded, a cast, or offloaded: a gather reads the master
};

// The bytes `where` holds for one flat param.
TierBytes state_bytes(const StateTiers& where, FlatParamKind kind, const FlatParamIo& f);

// Bytes one training step moves for one flat param, in the steady state.
struct StepIo {
  int64_t disk_read = 0, disk_write = 0, to_device = 0, to_host = 0;
  StepIo& operator+=(const StepIo& o);
};
StepIo step_io(const StateTiers& where, FlatParamKind kind, const FlatParamIo& f);

// A unit as the choice of kept forward reads sees it (Note [Kept master reads] in
// src/shard/sharded_unit.cpp).
struct ForwardRead {
  const void* unit = nullptr;       // its identity: a unit that runs forward twice keeps once
  bool forward_had_grad = true;     // false under activation checkpointing: its read is not kept
  bool gathers_in_backward = true;  // false when it keeps its params (or a group's part) for backward
  int64_t disk_bytes = 0;           // whole pages of its disk-tier masters' reads
};
// Of the units in forward order, the indices of those that keep their forward all-gather's read
// of a disk-tier master for their backward gather: the last to run forward that gather again in
// backward, as many as fit in half of `budget_bytes`. The runtime and the planner both apply it.
std::vector<size_t> units_keeping_forward_reads(const std::vector<ForwardRead>& forward_order, int64_t budget_bytes);

// Whole pages: what the disk tier's direct I/O moves for `bytes`.
inline int64_t whole_pages(int64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

}  // namespace fsdp::offload
