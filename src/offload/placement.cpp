// Note [Placement rules]
// Each rule exists here once; the runtime and the planner both apply it.
//  1. The master follows its state. With the params and the gradients on the device and only the
//     optimizer state offloaded (ZeRO-Offload), the fp32 master lives with its state and is stepped
//     there (on the CPU); the device keeps a working copy in the compute dtype, which the optimizer
//     refreshes after each step and the all-gather reads. A frozen flat param has no state to follow.
//  2. A frozen shard in a stored form (bf16, int8, NF4: no fp32 master) goes where the params go:
//     the host tier (a run with no host staging, a CPU run, keeps it in memory), or the disk tier,
//     read from its file for every gather like a master (Note [A stored form in the disk tier] in
//     residency.cpp): a base larger than memory streams. A frozen fp32 master is a master like a
//     trainable one's.
//  3. On a device, a unit offloads all of its states, or its optimizer state alone (the master then
//     follows it), or none: the optimizer steps where the master shard lives, on the CPU for an
//     offloaded one, so its gradient must come to the host and its result go back.
//  4. What a step moves. The disk tier reads a disk-tier master for each gather, except the
//     backward gather of a unit that kept its forward read; on a device, each gather of a host-tier
//     master (or a disk-tier one, through host memory) copies the shard to the device, cast to the
//     compute dtype (a stored frozen shard in its stored form). The step
//     reads and writes every disk-tier state it updates (the master, each state tensor) once, less
//     the master a backward gather read for a step in backward, and reads a disk-tier gradient
//     shard when it streams; an offloaded gradient crosses to the host. A master that follows its
//     state sends its gradient to the host and its updated working copy back.
#include "offload/placement.h"

#include <algorithm>

#include "fsdp/errors.h"

namespace fsdp::offload {

bool master_follows_state(OffloadTier params, OffloadTier grads, OffloadTier optimizer_state) {
  return params == OffloadTier::kNone && grads == OffloadTier::kNone && optimizer_state != OffloadTier::kNone;
}

bool allowed_on_device(const OffloadPolicy& policy, bool device_is_cpu) {
  if (device_is_cpu || !policy.any() || master_follows_state(policy)) return true;
  return policy.params() != OffloadTier::kNone && policy.grads() != OffloadTier::kNone &&
         policy.optimizer_state() != OffloadTier::kNone;
}

void check_allowed_on_device(const OffloadPolicy& policy, const std::string& unit, bool device_is_cpu,
                             const std::string& device) {
  if (allowed_on_device(policy, device_is_cpu)) return;
  throw ConfigError(std::string("fsdp: unit '") + unit + "' offloads some states but not all (params=" +
                    offload_tier_name(policy.params()) + ", grads=" + offload_tier_name(policy.grads()) +
                    ", optimizer_state=" + offload_tier_name(policy.optimizer_state()) + ") while computing on " +
                    device +
                    "; on a device the optimizer steps on the CPU, so offload params, grads "
                    "and optimizer_state together (each \"host\" or \"disk\"), or optimizer_state alone (the "
                    "fp32 master follows it), or none of them");
}

bool needs_stager(const OffloadPolicy& policy, bool device_is_cpu) {
  return policy.uses(OffloadTier::kHost) || (policy.any() && !device_is_cpu) || master_follows_state(policy);
}

StateTiers place(const OffloadPolicy& policy, FlatParamKind kind, bool has_stager) {
  StateTiers t;
  t.working_copy = kind.trainable && master_follows_state(policy);
  if (t.working_copy) {
    t.master = policy.optimizer_state();
  } else if (kind.stored_frozen && policy.params() == OffloadTier::kHost) {
    t.master = has_stager ? OffloadTier::kHost : OffloadTier::kNone;
  } else {
    t.master = policy.params();
  }
  t.grads = kind.trainable ? policy.grads() : OffloadTier::kNone;
  t.optimizer_state = kind.trainable ? policy.optimizer_state() : OffloadTier::kNone;
  return t;
}

TierBytes state_bytes(const StateTiers& where, FlatParamKind kind, const FlatParamIo& f) {
  TierBytes b;
  b[where.master] += f.master_bytes;
  if (where.working_copy) b[OffloadTier::kNone] += f.compute_bytes;
  if (kind.trainable) {
    b[where.grads] += f.master_bytes;
    b[where.optimizer_state] += f.state_tensors * (f.master_bytes / 4) * f.state_element_bytes;  // fp32 master
  }
  return b;
}

std::vector<size_t> units_keeping_forward_reads(const std::vector<ForwardRead>& forward_order, int64_t budget_bytes) {
  std::vector<size_t> out;
  std::vector<const void*> kept;
  int64_t room = budget_bytes / 2;
  for (size_t i = forward_order.size(); i-- > 0;) {
    const ForwardRead& u = forward_order[i];
    if (std::find(kept.begin(), kept.end(), u.unit) != kept.end()) continue;
    if (!u.forward_had_grad || !u.gathers_in_backward || u.disk_bytes == 0) continue;
    if (u.disk_bytes > room) break;
    room -= u.disk_bytes;
    kept.push_back(u.unit);
    out.push_back(i);
  }
  return out;
}

StepIo& StepIo::operator+=(const StepIo& o) {
  disk_read += o.disk_read;
  disk_write += o.disk_write;
  to_device += o.to_device;
  to_host += o.to_host;
  return *this;
}

StepIo step_io(const StateTiers& where, FlatParamKind kind, const FlatParamIo& f) {
  StepIo io;
  const OffloadTier master = where.master;
  const int64_t pages = whole_pages(f.master_bytes);
  if (!where.working_copy && f.gathers_at_all) {
    if (master == OffloadTier::kDisk) io.disk_read += (f.gathers - (f.forward_kept && f.gathers == 2 ? 1 : 0)) * pages;
    // A stored frozen shard crosses as stored; a master after its cast to the compute dtype.
    if (master == OffloadTier::kHost || (master == OffloadTier::kDisk && !f.device_is_cpu)) {
      io.to_device += f.gathers * (kind.stored_frozen ? f.master_bytes : f.compute_bytes);
    }
  }
  if (!kind.trainable) return io;
  if (where.grads == OffloadTier::kHost || (where.grads == OffloadTier::kDisk && !f.device_is_cpu)) {
    io.to_host += f.reduced_bytes;
  }
  const int64_t streamed =
      (master == OffloadTier::kDisk ? 1 : 0) + (where.optimizer_state == OffloadTier::kDisk ? f.state_tensors : 0);
  const bool master_kept = f.step_in_backward && !where.working_copy && master == OffloadTier::kDisk && f.gathers == 2;
  io.disk_read += (streamed - (master_kept ? 1 : 0)) * pages;
  io.disk_write += streamed * pages;
  // The optimizer reads a disk-tier gradient shard through the I/O threads when it streams.
  if (where.grads == OffloadTier::kDisk && streamed > 0) io.disk_read += pages;
  if (where.working_copy) {
    io.to_host += f.master_bytes;     // the gradient to the step with the master
    io.to_device += f.compute_bytes;  // the updated master, cast, back to the working copy
  }
  return io;
}

}  // namespace fsdp::offload
