// fully_shard: shard a LibTorch module's parameters across the ranks of a mesh.
//
//   for (auto& block : model->layers) fsdp::fully_shard(block, mesh, opts);   // bottom-up
//   auto root = fsdp::fully_shard(model, mesh, opts);
//   auto loss = fsdp::call(model, tokens, targets);    // forward through the sharded root
//   loss.backward();
//
// LibTorch modules have no forward hooks, so a sharded module is run through fsdp::call, which
// gathers its parameters before the module's own forward and frees them after; inside a model's
// forward, call sharded children the same way (`x = fsdp::call(layer, x)`). fsdp::call on an
// unsharded module is a plain forward, so a model written this way runs sharded or not.
// Backward needs nothing: hooks on the outputs gather again, gradient hooks reduce-scatter, and
// an end-of-backward callback finishes every unit.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/device_mesh.h"
#include "fsdp/options.h"

namespace fsdp {

class FSDPModule;
class ShardedUnit;  // private (src/shard): only handles and fsdp::call's scope hold one
class Tracer;

namespace detail {
struct FSDPModuleAccess;  // the library's own access to the unit behind a handle
}  // namespace detail

// A gather issued with FSDPModule::unshard(async = true); wait() makes the params usable.
class UnshardHandle {
 public:
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<ShardedUnit> unit) : unit_(std::move(unit)) {}
  std::shared_ptr<ShardedUnit> unit_;
};

// The handle fully_shard returns: one sharded unit (the module's parameters not owned by a unit
// nested inside it). The unit applied last over a module tree is the root.
class FSDPModule {
 public:
  // Gradient accumulation: with sync off, backward keeps unreduced gradients locally and skips
  // communication; the next backward with sync on reduces the sum. Applies to every unit under
  // this one.
  void set_requires_gradient_sync(bool sync);

  // Explicit control of gathering: unshard() issues this unit's all-gather (and waits unless
  // async); reshard() frees the gathered params. The lists below replace the recorded-order
  // prefetch targets of this unit in forward / backward.
  std::shared_ptr<UnshardHandle> unshard(bool async = false);
  void reshard();
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules);
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules);

  // Root only: trace every unit's forward/backward, its collectives and waits, and the optimizer.
  void set_tracer(std::shared_ptr<Tracer> tracer);

 private:
  friend struct detail::FSDPModuleAccess;
  explicit FSDPModule(std::shared_ptr<ShardedUnit> unit) : unit_(std::move(unit)) {}
  std::shared_ptr<ShardedUnit> unit_;
};

std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<torch::nn::Module>& module, DeviceMesh& mesh,
                                        const FullyShardOptions& options = {});

template <typename ModuleType>
std::shared_ptr<FSDPModule> fully_shard(torch::nn::ModuleHolder<ModuleType>& module, DeviceMesh& mesh,
                                        const FullyShardOptions& options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), mesh, options);
}

namespace detail {
// The unit of a sharded module, or null.
ShardedUnit* unit_of(const torch::nn::Module& module);

// Runs around the wrapped forward: before() gathers, after() frees and hooks outputs for backward.
class ForwardScope {
 public:
  explicit ForwardScope(ShardedUnit& unit);
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  at::Tensor input(const at::Tensor& t);   // casts floating inputs to the policy's param_dtype
  at::Tensor output(const at::Tensor& t);  // casts to its output_dtype, registers the pre-backward hook
  void finish();                           // post-forward

 private:
  ShardedUnit& unit_;
  bool finished_ = false;
};

template <typename T>
decltype(auto) map_input(ForwardScope& s, T&& v) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return s.input(v);
  } else {
    return std::forward<T>(v);
  }
}

inline at::Tensor map_output(ForwardScope& s, at::Tensor t) { return s.output(t); }
inline std::vector<at::Tensor> map_output(ForwardScope& s, std::vector<at::Tensor> ts) {
  for (auto& t : ts) t = s.output(t);
  return ts;
}
template <typename... Ts>
std::tuple<Ts...> map_output(ForwardScope& s, std::tuple<Ts...> tup) {
  std::apply([&](auto&... e) { ((e = map_output(s, std::move(e))), ...); }, tup);
  return tup;
}
template <typename T>
T map_output(ForwardScope&, T v) {
  return v;
}
}  // namespace detail

// Runs module->forward(args...) as a sharded unit when fully_shard was applied to it; a plain
// forward otherwise. `module` is a ModuleHolder (torch::nn::Linear, TORCH_MODULE types) or a
// std::shared_ptr to a module.
template <typename M, typename... Args>
auto call(M& module, Args&&... args) -> decltype(module->forward(std::forward<Args>(args)...)) {
  ShardedUnit* unit = detail::unit_of(*module);
  if (unit == nullptr) return module->forward(std::forward<Args>(args)...);
  detail::ForwardScope scope(*unit);
  auto out = module->forward(detail::map_input(scope, std::forward<Args>(args))...);
  auto mapped = detail::map_output(scope, std::move(out));
  scope.finish();
  return mapped;
}

}  // namespace fsdp
