// fsdp::Sharded: a sharded block inside a stock container. torch::nn::Sequential and AnyModule
// call their children's forward themselves, never through fsdp::call, so a block that is its own
// unit goes in wrapped: Sharded<M> holds the block, exposes its parameters, buffers and children
// under the block's own names (a checkpoint keeps `0.weight`, not `0.module.weight`), and its
// forward, with the block's signature, runs the block as its unit.
//
//   torch::nn::Sequential net(fsdp::Sharded(torch::nn::Linear(64, 128)), torch::nn::BatchNorm1d(128),
//                             torch::nn::ReLU(), fsdp::Sharded(torch::nn::Linear(128, 10)));
//   for (auto& block : fsdp::sharded_children(*net)) fsdp::fully_shard(block, mesh);
//   auto root = fsdp::fully_shard(net, mesh);
//   auto loss = loss_fn(fsdp::call(net, x), y);
//
// Or rebuild an existing Sequential: net = fsdp::wrap_children<torch::nn::LinearImpl>(net).
// A torch::nn::Sequential block goes in as it is (Sharded(Sequential(Conv2d, BatchNorm2d, ReLU,
// MaxPool2d)): Tensor -> Tensor); a ModuleList needs no wrapper: your forward calls its blocks, as
// fsdp::call(list->ptr<Block>(i), h). A block whose forward cannot be deduced (a ModuleList or
// ModuleDict itself, a template or overloaded forward) is a compile-time error saying so.
// Unsharded (no fully_shard), Sharded<M> is a plain forward: the same model runs either way.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "fsdp/fully_shard.h"

namespace fsdp {

namespace detail {
// What every Sharded<M> is: fsdp::call and the container check recognise it by this base.
class ShardedModuleBase : public torch::nn::Module {
 public:
  explicit ShardedModuleBase(const std::shared_ptr<torch::nn::Module>& inner);
  // train()/eval() reach the wrapped block too (its own is_training() is what its forward reads).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;
  const std::shared_ptr<torch::nn::Module>& inner_module() const { return inner_; }

 protected:
  ShardedUnit* unit() const { return unit_of(*this); }

 private:
  std::shared_ptr<torch::nn::Module> inner_;
};
}  // namespace detail

namespace detail {
template <typename M>
inline constexpr bool always_false_module = false;

// The block's forward as a member-function pointer type, or void when it cannot be deduced:
//  - a forward that is one non-template, non-overloaded member (it may be inherited), e.g. a
//    user's module deriving from torch::nn::ModuleList or ModuleDict with its own forward;
//  - else, for torch::nn::Sequential (or a module deriving from it without its own forward),
//    SequentialImpl::forward<Tensor> on one Tensor: Tensor -> Tensor.
template <typename M, typename = void>
struct own_forward {
  using type = void;
};
template <typename M>
struct own_forward<M, std::void_t<decltype(&M::forward)>> {
  using type = decltype(&M::forward);
};
template <typename M, typename Own = typename own_forward<M>::type>
struct block_forward {
  using type = Own;
};
template <typename M>
struct block_forward<M, void> {
  using type = std::conditional_t<std::is_base_of_v<torch::nn::SequentialImpl, M>,
                                  at::Tensor (torch::nn::SequentialImpl::*)(const at::Tensor&), void>;
};
}  // namespace detail

template <typename M, typename Forward = typename detail::block_forward<M>::type>
class ShardedImpl : public detail::ShardedModuleBase {
  static_assert(detail::always_false_module<M>,
                "fsdp::Sharded: cannot deduce the block's forward. Sharded takes a block whose forward is one "
                "non-template, non-overloaded member function (it may be inherited), or a torch::nn::Sequential "
                "(run as Tensor -> Tensor). torch::nn::ModuleList and ModuleDict have no forward: shard the module "
                "whose forward loops over them (fsdp::call on each block), or derive your own module from them and "
                "give it a forward. For a template or overloaded forward, wrap the block in a small module with "
                "one forward that calls it (docs/WRAPPING.md)");

 public:
  explicit ShardedImpl(std::shared_ptr<M> block) : ShardedModuleBase(block) {}
  explicit ShardedImpl(const torch::nn::ModuleHolder<M>& block) : ShardedImpl(block.ptr()) {}
  at::Tensor forward(const at::Tensor& x) { return x; }  // never compiled into a program: see the assert
};

template <typename M, typename C, typename R, typename... Args>
class ShardedImpl<M, R (C::*)(Args...)> : public detail::ShardedModuleBase {
 public:
  explicit ShardedImpl(std::shared_ptr<M> block) : ShardedModuleBase(block), block_(std::move(block)) {}
  explicit ShardedImpl(const torch::nn::ModuleHolder<M>& block) : ShardedImpl(block.ptr()) {}
  R forward(Args... args) {
    ShardedUnit* u = unit();
    if (u == nullptr) return block_->forward(std::forward<Args>(args)...);
    return detail::run_in_unit(
        *u, [this](auto&&... a) { return block_->forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
  const std::shared_ptr<M>& block() const { return block_; }

 private:
  std::shared_ptr<M> block_;
};

template <typename M, typename C, typename R, typename... Args>
class ShardedImpl<M, R (C::*)(Args...) const> : public ShardedImpl<M, R (C::*)(Args...)> {
 public:
  using ShardedImpl<M, R (C::*)(Args...)>::ShardedImpl;
};

// The holder (as torch::nn::Linear is LinearImpl's): Sharded(torch::nn::Linear(4, 8)).
template <typename M>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<M>> {
 public:
  using Base = torch::nn::ModuleHolder<ShardedImpl<M>>;
  Sharded(const torch::nn::ModuleHolder<M>& block) : Base(std::make_shared<ShardedImpl<M>>(block.ptr())) {}
  Sharded(std::shared_ptr<M> block) : Base(std::make_shared<ShardedImpl<M>>(std::move(block))) {}
  Sharded(std::shared_ptr<ShardedImpl<M>> impl) : Base(std::move(impl)) {}
};
template <typename M>
Sharded(const torch::nn::ModuleHolder<M>&) -> Sharded<M>;
template <typename M>
Sharded(std::shared_ptr<M>) -> Sharded<M>;

// The Sharded children of a Sequential (or any module), in order: what to fully_shard, one unit each.
std::vector<std::shared_ptr<torch::nn::Module>> sharded_children(const torch::nn::Module& module);

// A Sequential with the same children under the same names, every child of type M wrapped in
// Sharded<M>. Rebuild before sharding; a Sequential registered inside another module goes back
// with parent->replace_module(name, rebuilt).
template <typename M>
torch::nn::Sequential wrap_children(const torch::nn::Sequential& seq) {
  if (detail::unit_of(*seq) != nullptr) {
    throw ConfigError("fsdp: wrap_children got a Sequential that is already sharded; wrap its children first");
  }
  torch::nn::Sequential out;
  const auto names = seq->named_children();
  size_t i = 0;
  for (const auto& any : *seq) {
    const std::string& name = names[i++].key();
    if (any.type_info() == typeid(M)) {
      out->push_back(name, torch::nn::AnyModule(std::make_shared<ShardedImpl<M>>(any.ptr<M>())));
    } else {
      out->push_back(name, any);
    }
  }
  return out;
}

}  // namespace fsdp
