// memory_report: bytes per category, summed over every unit under a root.
#include "fsdp/memory.h"

#include <sstream>

#include "fsdp/optim.h"
#include "shard/sharded_unit.h"

namespace fsdp {

std::string MemoryReport::to_string() const {
  std::ostringstream s;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  s.precision(3);
  s << std::fixed << "params " << mib(sharded_params) << " MiB, grads " << mib(sharded_grads) << " MiB, optimizer "
    << mib(optimizer_state) << " MiB, gathered now " << mib(unsharded_alive) << " MiB (peak "
    << mib(peak_unsharded) << " MiB)";
  return s.str();
}

MemoryReport memory_report(FSDPModule& root, const ShardedOptimizer* optimizer) {
  MemoryReport r;
  for (const auto& unit : root.units()) {
    for (auto& fp : unit->flat_params()) {
      r.sharded_params += fp->sharded_param().numel() * fp->sharded_param().element_size();
      const auto& g = fp->sharded_grad();
      if (g.defined()) r.sharded_grads += g.numel() * g.element_size();
      r.unsharded_alive += fp->unsharded_bytes() + fp->unsharded_grad_bytes();
    }
  }
  if (root.unit().root() != nullptr) {
    r.peak_unsharded = std::max(root.unit().root_state().peak_unsharded_bytes, r.unsharded_alive);
  }
  if (optimizer != nullptr) r.optimizer_state = optimizer->state_bytes();
  return r;
}

}  // namespace fsdp
