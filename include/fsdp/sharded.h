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
// A ModuleList needs no wrapper: your forward calls its blocks, as fsdp::call(list->ptr<Block>(i), h).
// Unsharded (no fully_shard), Sharded<M> is a plain forward: the same model runs either way.
#pragma once

#include <memory>
#include <string>
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

template <typename M, typename Forward = decltype(&M::forward)>
class ShardedImpl;

// The block's forward must be one non-template, non-overloaded member (what AnyModule and
// Sequential need of any child anyway); it may be declared in a base class of M.
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
