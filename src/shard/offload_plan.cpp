// offload_plan and offload_io: what the tiers will hold and move per step, and what they moved.
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <sstream>

#include "base/strings.h"
#include "fsdp/offload.h"
#include "shard/grad_shards.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"
#include "offload/device_stager.h"
#include "offload/tier.h"

namespace fsdp {
namespace {

struct Tally {
  OffloadPlan& plan;
  void hold(OffloadTier tier, int64_t bytes) {
    (tier == OffloadTier::kDisk   ? plan.disk_bytes
     : tier == OffloadTier::kHost ? plan.host_bytes
                                  : plan.device_bytes) += bytes;
  }
};

// One flat param's bytes per tier and I/O per step. `step_in_backward`: the optimizer steps in
// backward, so the step takes the master a backward all-gather read (Note [The step in backward]).
// `forward_kept`: the unit keeps its forward read of the master for its backward gather.
void plan_flat(FlatParam& fp, int gathers, bool forward_kept, int state_tensors, bool device_is_cpu,
               bool step_in_backward, OffloadPlan& plan) {
  Tally tally{plan};
  const auto& off = fp.offload();
  const int64_t shard = fp.stores_frozen() ? fp.stored_bytes() : fp.shard_numel() * static_cast<int64_t>(sizeof(float));
  const int64_t compute = fp.shard_numel() * static_cast<int64_t>(c10::elementSize(fp.config().compute_dtype));
  const int64_t reduced = fp.shard_numel() * static_cast<int64_t>(c10::elementSize(fp.config().reduce_dtype));
  const bool follows = fp.master_follows_state();
  const OffloadTier master = follows ? off.optimizer_state : off.params;
  const bool trains = fp.config().requires_grad;
  tally.hold(master, shard);
  if (follows) tally.hold(OffloadTier::kNone, compute);
  if (trains) {
    tally.hold(off.grads, shard);
    tally.hold(off.optimizer_state, state_tensors * shard);
  }
  OffloadIo& io = plan.per_step;
  const bool gathers_at_all =
      fp.shard_group().size() > 1 || fp.config().compute_dtype != at::kFloat || master != OffloadTier::kNone;
  if (!follows && gathers_at_all) {
    if (master == OffloadTier::kDisk)
      io.disk_read += (gathers - (forward_kept && gathers == 2 ? 1 : 0)) * offload::whole_pages(shard);
    if (master == OffloadTier::kHost || (master == OffloadTier::kDisk && !device_is_cpu))
      io.to_device += gathers * compute;
  }
  if (!trains) return;
  if (off.grads == OffloadTier::kHost || (off.grads == OffloadTier::kDisk && !device_is_cpu)) io.to_host += reduced;
  const int64_t streamed =
      (master == OffloadTier::kDisk ? 1 : 0) + (off.optimizer_state == OffloadTier::kDisk ? state_tensors : 0);
  const bool master_kept = step_in_backward && !follows && master == OffloadTier::kDisk && gathers == 2;
  io.disk_read += (streamed - (master_kept ? 1 : 0)) * offload::whole_pages(shard);
  io.disk_write += streamed * offload::whole_pages(shard);
  if (off.grads == OffloadTier::kDisk && (master == OffloadTier::kDisk || off.optimizer_state == OffloadTier::kDisk)) {
    io.disk_read += offload::whole_pages(shard);  // the optimizer reads the gradient shard through the I/O threads
  }
  if (follows) {
    io.to_host += shard;      // the gradient to the CPU step
    io.to_device += compute;  // the updated master, cast, back to the working copy
  }
}

std::string bytes(int64_t b) { return base::mib(b, 1); }

}  // namespace

OffloadIo OffloadIo::operator-(const OffloadIo& e) const {
  return {disk_read - e.disk_read, disk_write - e.disk_write, to_device - e.to_device, to_host - e.to_host};
}

OffloadIo OffloadIo::per_step(int64_t steps) const {
  if (steps <= 0) return *this;
  return {disk_read / steps, disk_write / steps, to_device / steps, to_host / steps};
}

std::string OffloadIo::to_string() const {
  std::ostringstream s;
  s << "disk read " << bytes(disk_read) << ", disk write " << bytes(disk_write) << ", to device " << bytes(to_device)
    << ", to host " << bytes(to_host);
  return s.str();
}

std::string OffloadPlan::to_string() const {
  return "holds: device " + bytes(device_bytes) + ", host " + bytes(host_bytes) + ", disk " + bytes(disk_bytes) +
         "; moves per step: " + per_step.to_string();
}

OffloadPlan offload_plan_for(FSDPModule& root, int state_tensors, bool steps_in_backward) {
  OffloadPlan plan;
  const auto units = units_of(root);
  // The forward order the last step recorded; before the first step, registration order stands
  // for it. Gathers per step follow prefetch::keeps_params_after_forward, as the state machine does.
  const RootState& rs = unit_of(root).root_state();
  const auto order = rs.order.latest().empty() ? units : rs.units_in(rs.order.latest());
  const auto& tier = rs.disk_tier;
  const auto kept = tier ? units_keeping_forward_masters(order, tier->budget_bytes()) : std::vector<ShardedUnit*>{};
  for (ShardedUnit* u : units) {
    ShardedUnit& unit = *u;
    const bool device_is_cpu = unit.mesh().dist().compute_device().is_cpu();
    const int gathers = unit.gathers_in_backward(!order.empty() && order.back() == u) ? 2 : 1;
    const bool forward_kept = std::find(kept.begin(), kept.end(), &unit) != kept.end();
    for (auto& fp : unit.flat_params()) {
      plan_flat(*fp, gathers, forward_kept, state_tensors, device_is_cpu, steps_in_backward, plan);
    }
  }
  return plan;
}

OffloadIo offload_io(FSDPModule& root) {
  OffloadIo io;
  ShardedUnit& unit = unit_of(root);
  if (unit.root() != &unit) unit.lazy_init();
  RootState& rs = unit.root_state();
  if (rs.disk_tier) {
    const auto c = rs.disk_tier->io_counters();
    io.disk_read = c.bytes_read;
    io.disk_write = c.bytes_written;
  }
  if (rs.stager) {
    io.to_device = rs.stager->bytes_to_device();
    io.to_host = rs.stager->bytes_to_host();
  }
  return io;
}

}  // namespace fsdp
