// model_figures: the facts behind the memory figures (model_figures.h).
#include "shard/model_figures.h"

#include <algorithm>

#include "offload/residency.h"
#include "offload/tier.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace {

FlatFigures figures_of(FlatParam& fp, int gathers, bool forward_kept, bool device_is_cpu) {
  FlatFigures f;
  f.where = fp.state_tiers();
  f.kind = {fp.config().requires_grad, fp.stores_frozen()};
  f.io.master_bytes = fp.stores_frozen() ? fp.stored_bytes() : fp.shard_numel() * static_cast<int64_t>(sizeof(float));
  f.io.compute_bytes = fp.shard_numel() * static_cast<int64_t>(c10::elementSize(fp.config().compute_dtype));
  f.io.reduced_bytes = fp.shard_numel() * static_cast<int64_t>(c10::elementSize(fp.config().reduce_dtype));
  f.io.gathers = gathers;
  f.io.forward_kept = forward_kept;
  f.io.device_is_cpu = device_is_cpu;
  f.io.gathers_at_all =
      fp.shard_group().size() > 1 || fp.config().compute_dtype != at::kFloat || f.where.master != OffloadTier::kNone;
  f.master = fp.sharded_param();
  f.in_place_bytes = fp.residency().in_place_bytes();
  if (f.where.working_copy) f.working = fp.working_shard();
  f.grad = fp.sharded_grad();
  f.gathered_bytes = fp.unsharded_bytes();
  f.grad_buffer_bytes = fp.unsharded_grad_bytes();
  f.partial_grad_bytes = fp.grads().partial_bytes();
  return f;
}

}  // namespace

ModelFigures model_figures(FSDPModule& root) {
  ShardedUnit& top = unit_of(root);
  if (top.root() == nullptr) top.lazy_init();
  const RootState* rs = top.root() != nullptr ? &top.root_state() : nullptr;
  ModelFigures m;
  m.disk_tier = rs ? rs->disk_tier.get() : nullptr;
  m.stager = rs ? rs->stager.get() : nullptr;
  const auto units = units_of(root);
  // The forward order the last step recorded; before the first step, registration order stands
  // for it. Gathers per step follow prefetch::keeps_params_after_forward, as the state machine does.
  const auto order = rs == nullptr || rs->order.latest().empty() ? units : rs->units_in(rs->order.latest());
  const auto kept =
      m.disk_tier ? units_keeping_forward_masters(order, m.disk_tier->budget_bytes()) : std::vector<ShardedUnit*>{};
  int64_t gathered = 0;
  for (ShardedUnit* u : units) {
    const bool device_is_cpu = u->mesh().dist().compute_device().is_cpu();
    const int gathers = u->gathers_in_backward(!order.empty() && order.back() == u) ? 2 : 1;
    const bool forward_kept = std::find(kept.begin(), kept.end(), u) != kept.end();
    for (auto& fp : u->flat_params()) {
      m.flats.push_back(figures_of(*fp, gathers, forward_kept, device_is_cpu));
      gathered += m.flats.back().gathered_bytes + m.flats.back().grad_buffer_bytes;
    }
  }
  m.peak_gathered_bytes = std::max(rs ? rs->peak_unsharded_bytes : 0, gathered);
  return m;
}

}  // namespace fsdp
