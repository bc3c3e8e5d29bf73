// memory_report and offload_plan: the model's figures (shard/grad_shards.h) with the optimizer's
// state added.
#include "fsdp/memory.h"
#include "fsdp/offload.h"
#include "fsdp/optim.h"
#include "shard/grad_shards.h"

namespace fsdp {

MemoryReport memory_report(FSDPModule& root, const ShardedOptimizer* optimizer) {
  MemoryReport r = model_memory(root);
  if (optimizer == nullptr) return r;
  GradShards shards(root);
  for (const auto& s : optimizer->states()) {
    for (const auto& [name, t] : s.tensors) {
      if (t.defined()) count_in_tier(r, t, shards.all().at(s.flat_index).state_tier());
    }
  }
  r.optimizer_state = optimizer->state_bytes();
  return r;
}

OffloadPlan offload_plan(FSDPModule& root, const ShardedOptimizer& optimizer) {
  return offload_plan_for(root, static_cast<int>(optimizer.state_names().size()), optimizer.steps_in_backward());
}

}  // namespace fsdp
