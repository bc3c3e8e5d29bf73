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

#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/nn/pimpl.h>

#include "fsdp/device_mesh.h"
#include "fsdp/errors.h"
#include "fsdp/options.h"

namespace fsdp {

class FSDPModule;
class ShardedUnit;  // private (src/shard): only handles and fsdp::call's scope hold one
class Tracer;

namespace detail {
struct FSDPModuleAccess;  // the library's own access to the unit behind a handle
class ShardedModuleBase;  // fsdp::Sharded (fsdp/sharded.h)
}  // namespace detail

// The customization point through which fsdp::call finds the tensors of a user type a forward
// returns (so each gets the hook that gathers the unit again for backward). Specialise it:
//
//   template <> struct fsdp::ForwardOutput<MyOutput> {
//     template <typename F> static void for_each_tensor(MyOutput& out, F&& f) { f(out.logits); f(out.aux); }
//   };
//
// Without a specialisation, a type fsdp does not know is a compile-time error in fsdp::call.
template <typename T>
struct ForwardOutput;

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
  // Hybrid sharding (kHybridShard): whether a backward that reduces gradients also all-reduces
  // them across the replicas. With it off, each micro-batch's gradients are reduce-scattered
  // within the replica (so no unsharded gradient stays behind) and their sum waits, in a
  // partial-sum shard, for the next backward with it on, which all-reduces the sum once: one
  // cross-replica all-reduce per step instead of one per micro-batch. The gradient shards the
  // optimizer reads are unchanged until then. Without replicas it changes nothing. Applies to
  // every unit under this one; not with an optimizer that steps in backward (UsageError).
  void set_requires_all_reduce(bool all_reduce);

  // Keeping gathered parameters (FSDP2's names). With reshard_after_forward false, a unit keeps its
  // gathered parameters from its forward to its backward (overrides
  // FullyShardOptions::reshard_after_forward); with reshard_after_backward false, it keeps them
  // after its backward too, so the next forward and backward gather nothing. Both false for every
  // micro-batch but the last of a step: one all-gather per unit per step instead of one or two per
  // micro-batch, at the cost of the unit's gathered parameters held throughout (Note [Kept
  // gathers] in src/shard/sharded_unit.cpp). A kept gather is never stale: once the optimizer has
  // stepped a flat param (or a checkpoint load wrote it), its next use gathers it again; a frozen
  // one stays. `recurse`: every unit under this one too, else this unit only. Once set, the
  // forward's default (the root and the last unit to run keep their params for backward) gives way
  // to the value set, true included.
  void set_reshard_after_forward(bool reshard, bool recurse = true);
  void set_reshard_after_backward(bool reshard, bool recurse = true);

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

template <typename T>
inline constexpr bool always_false = false;
template <typename T, typename = void>
struct has_forward_output : std::false_type {};
template <typename T>
struct has_forward_output<T, std::void_t<decltype(sizeof(ForwardOutput<T>))>> : std::true_type {};
template <typename T>
struct is_vector : std::false_type {};
template <typename T, typename A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <typename T>
struct is_array : std::false_type {};
template <typename T, size_t N>
struct is_array<std::array<T, N>> : std::true_type {};
template <typename T>
struct is_tuple_like : std::false_type {};
template <typename... Ts>
struct is_tuple_like<std::tuple<Ts...>> : std::true_type {};
template <typename A, typename B>
struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};
template <typename T>
struct is_string_map : std::false_type {};
template <typename V, typename C, typename A>
struct is_string_map<std::map<std::string, V, C, A>> : std::true_type {};
template <typename V, typename H, typename E, typename A>
struct is_string_map<std::unordered_map<std::string, V, H, E, A>> : std::true_type {};
template <typename T>
struct is_ordered_dict : std::false_type {};
template <typename V>
struct is_ordered_dict<torch::OrderedDict<std::string, V>> : std::true_type {};
// Values that cannot hold a tensor: returned as they are.
template <typename T>
inline constexpr bool is_plain_value = std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string>;

// Gives every tensor in `v` the unit's output treatment (output_dtype cast, pre-backward hook),
// through any nesting of the containers above and user types with a ForwardOutput specialisation.
template <typename T>
void map_output(ForwardScope& s, T& v) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    v = s.output(v);
  } else if constexpr (has_forward_output<T>::value) {
    ForwardOutput<T>::for_each_tensor(v, [&s](at::Tensor& t) { t = s.output(t); });
  } else if constexpr (is_plain_value<T>) {
  } else if constexpr (is_vector<T>::value || is_array<T>::value) {
    if constexpr (!is_plain_value<typename T::value_type>) {
      for (auto& e : v) map_output(s, e);
    }
  } else if constexpr (is_tuple_like<T>::value) {
    std::apply([&s](auto&... e) { (map_output(s, e), ...); }, v);
  } else if constexpr (is_optional<T>::value) {
    if (v.has_value()) map_output(s, *v);
  } else if constexpr (is_string_map<T>::value) {
    for (auto& item : v) map_output(s, item.second);
  } else if constexpr (is_ordered_dict<T>::value) {
    for (auto& item : v) map_output(s, item.value());
  } else {
    static_assert(always_false<T>,
                  "fsdp::call: the forward returns a type fsdp cannot look into for tensors. Supported: at::Tensor, "
                  "arithmetic values, std::string, and any nesting of std::vector, std::array, std::tuple, std::pair, "
                  "std::optional and string-keyed std::map / std::unordered_map / torch::OrderedDict. For your own "
                  "type, specialise fsdp::ForwardOutput<T> with static void for_each_tensor(T&, F&&) calling F on "
                  "every at::Tensor& it holds (fsdp/fully_shard.h)");
  }
}

// Runs `forward(args...)` as `unit`'s forward: gathers, runs, hooks the outputs, frees.
template <typename F, typename... Args>
auto run_in_unit(ShardedUnit& unit, F&& forward, Args&&... args) {
  using R = decltype(forward(map_input(std::declval<ForwardScope&>(), std::forward<Args>(args))...));
  ForwardScope scope(unit);
  if constexpr (std::is_void_v<R>) {
    forward(map_input(scope, std::forward<Args>(args))...);
    scope.finish();
  } else {
    R out = forward(map_input(scope, std::forward<Args>(args))...);
    map_output(scope, out);
    scope.finish();
    return out;
  }
}

// A torch::nn::Sequential whose sharded children are not wrapped in fsdp::Sharded would call
// them past their units: refused before the forward starts (UsageError naming the child).
void check_container(const torch::nn::Module& module);
}  // namespace detail

// Runs module->forward(args...) as a sharded unit when fully_shard was applied to it; a plain
// forward otherwise. `module` is a ModuleHolder (torch::nn::Linear, TORCH_MODULE types), a
// std::shared_ptr to a module or a plain pointer (e.g. ModuleList::ptr<Block>(i)). Every tensor of
// the result (see ForwardOutput for what fsdp looks into) gets the hook that gathers the unit
// again for backward.
template <typename M, typename... Args>
auto call(M&& module, Args&&... args) {
  using Module = std::decay_t<decltype(*module)>;
  if constexpr (std::is_base_of_v<detail::ShardedModuleBase, Module>) {
    return module->forward(std::forward<Args>(args)...);  // fsdp::Sharded runs its unit itself
  } else {
    detail::check_container(*module);
    ShardedUnit* unit = detail::unit_of(*module);
    if (unit == nullptr) return module->forward(std::forward<Args>(args)...);
    return detail::run_in_unit(
        *unit, [&module](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
}

}  // namespace fsdp
