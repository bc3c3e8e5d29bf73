// What the layers above shard (the optimizers, clipping, the loss scaler, the memory report) see
// of a sharded model's trainable state: each flat param's fp32 master shard and its reduced
// gradient shard, where they live, and the hook the backward calls as each gradient is reduced
// (shard/post_reduce_hook.h). Nothing here exposes a unit or a flat param: the state machine stays
// private to src/shard.
//
//   GradShards shards(*root);                 // the handle's flat params, in flat-index order
//   for (GradShard& s : shards.all()) { s.collect_grad(); ... s.master() ... }
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/comm.h"
#include "fsdp/dist.h"
#include "fsdp/fully_shard.h"
#include "fsdp/options.h"
#include "shard/post_reduce_hook.h"

namespace fsdp {

class FlatParam;
class Tracer;
namespace offload {
class DiskTier;
}

// One flat param, as the optimizer sees it. A handle: cheap to copy, valid while the model is.
class GradShard {
 public:
  explicit GradShard(FlatParam* flat) : flat_(flat) {}

  // Identity: equal for handles of the same flat param.
  const void* key() const { return flat_; }
  const std::string& tag() const;  // "layers.0/1": for messages
  int group() const;               // optimizer group (FullyShardOptions::param_group)
  bool trainable() const;          // requires_grad: frozen flat params have no optimizer state
  int64_t numel() const;           // elements of this rank's shard

  // Where its sharded states live (resolved by the root's lazy init).
  OffloadTier grads_tier() const;
  OffloadTier state_tier() const;
  // The rank's disk tier when any state of this flat param is in it, else null.
  offload::DiskTier* disk_tier() const;

  // The live fp32 master shard (in its tier).
  at::Tensor& master();
  // The master's values a backward gather kept for the step, handed over once (undefined when
  // none was kept or the master was written since).
  at::Tensor take_master_for_step();
  // Null, or what brings derived copies (the working copy) up to date after the optimizer updated
  // elements [a, b) of the master; `updated` holds their new values (host memory).
  std::function<void(int64_t a, int64_t b, const at::Tensor& updated)> after_update();
  // A zero-filled tensor of `dtype` (fp32, or bf16 in RAM or the host tier) shaped like the master
  // shard, in the optimizer state's tier.
  at::Tensor new_state_tensor(const std::string& what, at::ScalarType dtype = at::kFloat);

  // Collects the gradient's reduction (if still in flight) and returns the fp32 gradient shard,
  // undefined when the flat param has no gradient yet.
  at::Tensor collect_grad();
  // UsageError when its gradient holds sums never all-reduced across the replicas
  // (FSDPModule::set_requires_all_reduce), naming `what` would read them.
  void check_all_reduced(const std::string& what) const;
  // The gradient shard as it is (after GradShards::collect_all), undefined before its first reduction.
  at::Tensor& grad();
  // Collects it and returns what the optimizer reads: the gradient shard, or its host copy when
  // the master follows an offloaded optimizer state.
  at::Tensor grad_for_step();
  // Collects it and drops the shard's values to zero (the buffer stays).
  void zero_grad();
  bool reduced_since_zero_grad() const;  // a reduction into it since zero_grad (a collective)
  // The group the shard's elements are distinct over (null when the shard is the whole flat
  // param): a norm sums each group's shards once.
  Communicator* norm_group() const;

 private:
  FlatParam* flat_;
};

// The flat params of a handle and the units under it (lazily initialising an unclaimed root).
class GradShards {
 public:
  explicit GradShards(FSDPModule& handle);

  // Every flat param, frozen ones included, in flat-index order (units pre-order, then each
  // unit's flat params): ShardState::flat_index indexes this.
  std::vector<GradShard>& all() { return shards_; }
  // Collects every reduction still in flight, last units first (the order backward issued them).
  void collect_all();

  Dist& dist();
  Tracer* tracer();
  // The rank's disk tier, null when no state is in one.
  offload::DiskTier* disk_tier();
  // Whether a backward is running now.
  bool in_backward();

  // Installs `hook` on the root (throws ConfigError when another one is installed, UsageError
  // during a backward); remove_hook takes it off again (only `hook` itself).
  void install_hook(PostReduceHook* hook);
  void remove_hook(PostReduceHook* hook);
  // The installed hook, or null.
  PostReduceHook* hook() { return hook_of(*handle_); }
  // The same for any handle, without walking its flat params.
  static PostReduceHook* hook_of(FSDPModule& handle);

 private:
  FSDPModule* handle_;
  std::vector<GradShard> shards_;
};

}  // namespace fsdp
