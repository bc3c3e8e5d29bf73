// model_memory: bytes per category and per offload tier, summed over every unit under a root (the
// optimizer layer's memory_report adds the optimizer state).
#include "fsdp/memory.h"

#include <sstream>

#include <ATen/core/Tensor.h>

#include "fsdp/offload.h"
#include "offload/tier.h"
#include "shard/grad_shards.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"

namespace fsdp {

std::string MemoryReport::to_string() const {
  std::ostringstream s;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  s.precision(3);
  s << std::fixed << "params " << mib(sharded_params) << " MiB, grads " << mib(sharded_grads) << " MiB, optimizer "
    << mib(optimizer_state) << " MiB, gathered now " << mib(unsharded_alive) << " MiB (peak " << mib(peak_unsharded)
    << " MiB)";
  if (tier_host > 0 || tier_disk > 0) {
    s << "; by tier: device " << mib(tier_device) << " MiB, host " << mib(tier_host) << " MiB, disk " << mib(tier_disk)
      << " MiB (" << mib(disk_resident) << " MiB of it in memory now)";
  }
  return s.str();
}

void count_in_tier(MemoryReport& r, const at::Tensor& t, OffloadTier tier) {
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (offload::is_disk_backed(t)) {
    r.tier_disk += bytes;
  } else if (tier == OffloadTier::kHost) {
    r.tier_host += bytes;
  } else {
    r.tier_device += bytes;
  }
}

MemoryReport model_memory(FSDPModule& root) {
  MemoryReport r;
  auto by_tier = [&r](const at::Tensor& t, OffloadTier tier) { count_in_tier(r, t, tier); };
  const auto flats = flat_params_of(root);
  for (FlatParam* fp : flats) {
    r.sharded_params += fp->sharded_param().numel() * fp->sharded_param().element_size();
    by_tier(fp->sharded_param(), fp->master_follows_state() ? fp->offload().optimizer_state : fp->offload().params);
    if (fp->master_follows_state()) {  // the working copy in param_dtype, with compute
      const auto& w = fp->working_shard();
      r.sharded_params += w.numel() * w.element_size();
      by_tier(w, OffloadTier::kNone);
    }
    const auto& g = fp->sharded_grad();
    if (g.defined()) {
      r.sharded_grads += g.numel() * g.element_size();
      by_tier(g, fp->offload().grads);
    }
    r.unsharded_alive += fp->unsharded_bytes() + fp->unsharded_grad_bytes();
    r.unsharded_grads_alive += fp->unsharded_grad_bytes();
  }
  r.disk_resident = disk_tier_stats(root).resident_bytes;
  ShardedUnit& unit = unit_of(root);
  if (unit.root() != nullptr) r.peak_unsharded = std::max(unit.root_state().peak_unsharded_bytes, r.unsharded_alive);
  return r;
}

}  // namespace fsdp
