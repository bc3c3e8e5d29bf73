// GradShards: the optimizer layer's view of a sharded model (grad_shards.h).
#include "shard/grad_shards.h"

#include "fsdp/errors.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"
#include "offload/tier_tensors.h"

namespace fsdp {

// ---- GradShard

const std::string& GradShard::tag() const { return flat_->config().tag; }
int GradShard::group() const { return flat_->config().group; }
bool GradShard::trainable() const { return flat_->config().requires_grad; }
int64_t GradShard::numel() const { return flat_->shard_numel(); }
OffloadTier GradShard::grads_tier() const { return flat_->offload().grads; }
OffloadTier GradShard::state_tier() const { return flat_->offload().optimizer_state; }
offload::DiskTier* GradShard::disk_tier() const { return flat_->offload().disk.get(); }

at::Tensor& GradShard::master() { return flat_->sharded_param(); }
at::Tensor GradShard::take_master_for_step() { return flat_->take_master_for_step(); }
std::function<void(int64_t, int64_t, const at::Tensor&)> GradShard::after_update() {
  return flat_->after_optimizer_update();
}
at::Tensor GradShard::new_state_tensor(const std::string& what, at::ScalarType dtype) {
  return flat_->new_state_tensor(what, dtype);
}

void GradShard::check_all_reduced(const std::string& what) const { flat_->grads().check_no_partial(what); }
bool GradShard::reduced_since_zero_grad() const { return flat_->grads().reduced_since_zero(); }

at::Tensor GradShard::collect_grad() {
  flat_->grads().finalize();
  flat_->grads().check_no_partial("the optimizer");
  flat_->gathered().master_will_change();  // TorchOptimizer steps what it collects
  return flat_->sharded_grad();
}

at::Tensor& GradShard::grad() { return flat_->sharded_grad(); }

at::Tensor GradShard::grad_for_step() { return flat_->optimizer_grad(); }

void GradShard::zero_grad() {
  flat_->grads().finalize();
  flat_->grads().zero();
}

Communicator* GradShard::norm_group() const {
  return flat_->shard_group().size() > 1 ? &flat_->shard_group() : nullptr;
}

// ---- GradShards

GradShards::GradShards(FSDPModule& handle) : handle_(&handle) {
  for (FlatParam* fp : flat_params_of(handle)) shards_.emplace_back(fp);
}

void GradShards::collect_all() {
  const auto units = units_of(*handle_);
  for (auto it = units.rbegin(); it != units.rend(); ++it) (*it)->collect_gradients();
}

Dist& GradShards::dist() { return unit_of(*handle_).mesh().dist(); }
Tracer* GradShards::tracer() { return unit_of(*handle_).tracer(); }

offload::DiskTier* GradShards::disk_tier() {
  ShardedUnit& unit = unit_of(*handle_);
  if (unit.root() == nullptr) unit.lazy_init();
  return unit.root_state().disk_tier.get();
}

bool GradShards::in_backward() {
  ShardedUnit& unit = unit_of(*handle_);
  return unit.root() != nullptr && unit.root_state().in_backward;
}

void GradShards::install_hook(PostReduceHook* hook) {
  ShardedUnit& unit = unit_of(*handle_);
  if (unit.root() == nullptr) unit.lazy_init();
  RootState& rs = unit.root_state();
  if (rs.post_reduce_hook != nullptr && rs.post_reduce_hook != hook) {
    throw ConfigError(
        "fsdp: another optimizer already steps this model in backward (step_in_backward): one "
        "optimizer per model can");
  }
  if (rs.in_backward) {
    throw UsageError("fsdp: step_in_backward turned on during a backward; turn it on before the backward");
  }
  rs.post_reduce_hook = hook;
}

void GradShards::remove_hook(PostReduceHook* hook) {
  ShardedUnit& unit = unit_of(*handle_);
  if (unit.root() == nullptr) return;
  RootState& rs = unit.root_state();
  if (rs.post_reduce_hook == hook) rs.post_reduce_hook = nullptr;
}

PostReduceHook* GradShards::hook_of(FSDPModule& handle) {
  ShardedUnit& unit = unit_of(handle);
  return unit.root() == nullptr ? nullptr : unit.root_state().post_reduce_hook;
}

}  // namespace fsdp
