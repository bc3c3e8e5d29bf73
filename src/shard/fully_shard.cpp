// The public face of a sharded unit: fully_shard, the FSDPModule handle, UnshardHandle and the
// scope fsdp::call runs a sharded forward in. Each forwards to the unit (sharded_unit.h).
#include "fsdp/fully_shard.h"

#include <ATen/ATen.h>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "shard/sharded_unit.h"
#include "offload/tier_tensors.h"

namespace fsdp {

std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<torch::nn::Module>& module, DeviceMesh& mesh,
                                        const FullyShardOptions& options) {
  if (!module) throw ConfigError("fsdp: fully_shard got a null module");
  if (ShardedUnit* sharded = detail::unit_of(*module)) {
    const std::string path = sharded->path_before_root();
    throw ConfigError("fsdp: fully_shard was already applied to " +
                      (path == "<root>" ? "this module (" + module->name() + ")" : "module '" + path + "'") +
                      "; shard each module once");
  }
  auto unit = std::make_shared<ShardedUnit>(module, mesh, options);
  unit->build();
  return detail::FSDPModuleAccess::make(unit);
}

std::vector<ShardedUnit*> units_of(const FSDPModule& handle) {
  ShardedUnit& unit = unit_of(handle);
  if (unit.root() == nullptr) unit.lazy_init();
  return unit.subtree_units();
}

std::vector<FlatParam*> flat_params_of(const FSDPModule& handle) {
  std::vector<FlatParam*> out;
  for (ShardedUnit* unit : units_of(handle)) {
    for (auto& fp : unit->flat_params()) out.push_back(fp.get());
  }
  return out;
}

// ---- FSDPModule

void FSDPModule::set_requires_gradient_sync(bool sync) {
  for (ShardedUnit* unit : unit_->subtree_units()) unit->set_requires_gradient_sync(sync);
}

void FSDPModule::set_reshard_after_forward(bool reshard, bool recurse) {
  if (!recurse) return unit_->set_reshard_after_forward(reshard);
  for (ShardedUnit* unit : unit_->subtree_units()) unit->set_reshard_after_forward(reshard);
}

void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) {
  if (!recurse) return unit_->set_reshard_after_backward(reshard);
  for (ShardedUnit* unit : unit_->subtree_units()) unit->set_reshard_after_backward(reshard);
}

void FSDPModule::set_requires_all_reduce(bool all_reduce) {
  for (ShardedUnit* unit : unit_->subtree_units()) {
    for (auto& fp : unit->flat_params()) {
      // Parameters kept whole on every rank have no replicas' all-reduce to skip without a replica
      // dimension: their all-reduce is their whole reduction.
      if (fp->config().replicated && unit->mesh().replicate_size() == 1) continue;
      fp->grads().set_requires_all_reduce(all_reduce);
    }
  }
}

void FSDPModule::set_tracer(std::shared_ptr<Tracer> tracer) {
  if (unit_->root() != unit_.get()) unit_->lazy_init();
  unit_->root_state().tracer = tracer;
  if (unit_->root_state().disk_tier) unit_->root_state().disk_tier->set_tracer(tracer);
  for (ShardedUnit* unit : unit_->root_state().units) {
    for (auto& fp : unit->flat_params()) {
      fp->shard_group().set_tracer(tracer);
      fp->replicate_group().set_tracer(tracer);
    }
    for (Communicator* g : unit->mesh().groups_made_on_use()) g->set_tracer(tracer);
  }
}

std::shared_ptr<UnshardHandle> FSDPModule::unshard(bool async) {
  if (unit_->root() == nullptr) unit_->lazy_init();
  unit_->unshard();
  auto handle = std::shared_ptr<UnshardHandle>(new UnshardHandle(unit_));
  if (!async) handle->wait();
  return handle;
}

void FSDPModule::reshard() { unit_->reshard(); }

void UnshardHandle::wait() {
  if (unit_) unit_->wait_for_unshard();
  unit_.reset();
}

namespace {
std::vector<ShardedUnit*> raw_units(const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  std::vector<ShardedUnit*> out;
  for (const auto& m : modules) {
    if (!m) throw ConfigError("fsdp: a prefetch list holds a null module");
    out.push_back(&unit_of(*m));
  }
  return out;
}
}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  unit_->set_forward_prefetch(raw_units(modules));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  unit_->set_backward_prefetch(raw_units(modules));
}

// ---- fsdp::call

namespace detail {

ForwardScope::ForwardScope(ShardedUnit& unit) : unit_(unit) { unit_.pre_forward(); }

ForwardScope::~ForwardScope() {
  if (finished_) return;
  try {
    unit_.post_forward();  // an exception escaped the forward; leave the unit consistent
  } catch (...) {
  }
}

at::Tensor ForwardScope::input(const at::Tensor& t) {
  const auto& dtype = unit_.options().mp_policy.param_dtype();
  if (dtype && t.defined() && t.is_floating_point() && t.scalar_type() != *dtype)
    return unit_.track_input(t.to(*dtype));
  return unit_.track_input(t);
}

at::Tensor ForwardScope::output(const at::Tensor& t) {
  at::Tensor out = t;
  const auto& dtype = unit_.options().mp_policy.output_dtype();
  if (dtype && out.defined() && out.is_floating_point() && out.scalar_type() != *dtype) out = out.to(*dtype);
  if (out.defined() && out.requires_grad()) {
    unit_.output_hooked();
    std::weak_ptr<ShardedUnit> weak = unit_.weak_from_this();
    out.register_hook([weak](const at::Tensor&) {
      if (auto unit = weak.lock()) unit->pre_backward();
    });
  }
  return out;
}

void ForwardScope::finish() {
  finished_ = true;
  unit_.post_forward();
}

}  // namespace detail
}  // namespace fsdp
