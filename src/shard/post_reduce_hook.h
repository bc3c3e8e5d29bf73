// The post-reduce hook: how the backward hands each flat param to the optimizer as soon as its
// reduced gradient is collected (at the next unit's backward, not at the end of the backward;
// Note [The step in backward] in sharded_unit.cpp). The one declaration, which the shard layer
// (RootState, the backward, GradShards::install_hook) and the optimizer (the step in backward, the
// read-ahead of disk-tier state, clipping, the loss scaler) include.
//
// PyTorch's optimizer-in-backward is built the same way, on post-accumulate-grad hooks; here the
// hook fires when the reduce-scatter of a flat param's gradient has been collected.
#pragma once

namespace fsdp {

class GradShard;  // shard/grad_shards.h

// Called by the backward with each flat param whose reduced gradient it has just collected.
// At most one per model (GradShards::install_hook).
class PostReduceHook {
 public:
  virtual ~PostReduceHook() = default;
  virtual void gradient_reduced(GradShard& shard) = 0;
  // Whether the hook applies the gradient during backward (the step in backward), so that nothing
  // can rescale or skip it afterwards (clipping and loss scaling refuse); a hook that only reads
  // ahead for the step after backward does not.
  virtual bool applies_gradients() const { return true; }
};

// Whether `hook` (null: none installed) applies gradients during backward: the one test behind
// ShardedUnit::steps_in_backward, clipping's and the loss scaler's refusals.
inline bool applies_gradients(const PostReduceHook* hook) { return hook != nullptr && hook->applies_gradients(); }

}  // namespace fsdp
