// Stock torch::optim optimizers stepping a sharded model: the optimizer is built over the flat fp32
// master shards (one parameter group per flat param), so its state is sharded like fsdp's own
// optimizers' and checkpoints save and restore it the same way.
//
//   auto optim = fsdp::TorchOptimizer::make<torch::optim::Adam>(root, torch::optim::AdamOptions(1e-3));
//   loss.backward(); optim->step(); optim->zero_grad();
//
// Only element-wise optimizers can step a shard as the same elements of the whole parameter:
// SGD, Adam, AdamW, RMSprop and Adagrad. Any other type (LBFGS, which needs the whole gradient
// for its line search, or a user's own optimizer) is refused with ConfigError.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <c10/util/Type.h>
#include <torch/optim.h>

#include "fsdp/optim.h"

namespace fsdp {

enum class TorchOptimKind { kSGD, kAdam, kAdamW, kRMSprop, kAdagrad, kUnsupported };

namespace detail {
template <typename O>
constexpr TorchOptimKind torch_optim_kind() {
  if constexpr (std::is_same_v<O, torch::optim::SGD>) return TorchOptimKind::kSGD;
  else if constexpr (std::is_same_v<O, torch::optim::Adam>) return TorchOptimKind::kAdam;
  else if constexpr (std::is_same_v<O, torch::optim::AdamW>) return TorchOptimKind::kAdamW;
  else if constexpr (std::is_same_v<O, torch::optim::RMSprop>) return TorchOptimKind::kRMSprop;
  else if constexpr (std::is_same_v<O, torch::optim::Adagrad>) return TorchOptimKind::kAdagrad;
  else return TorchOptimKind::kUnsupported;
}
}  // namespace detail

class TorchOptimizer : public ShardedOptimizer {
 public:
  // Builds an optimizer of type O with `options` over `root`'s master shards. Every flat param
  // gets `options` (weight decay included, as the same optimizer over the unsharded model's
  // parameters would); set_group_options overrides a group's lr scale and weight decay. Change
  // the learning rate with set_lr (or an LRScheduler), not through the torch optimizer's groups.
  template <typename O, typename Options>
  static std::unique_ptr<TorchOptimizer> make(const std::shared_ptr<FSDPModule>& root, const Options& options) {
    constexpr TorchOptimKind kind = detail::torch_optim_kind<O>();
    std::unique_ptr<TorchOptimizer> self(new TorchOptimizer(root, kind, c10::demangle(typeid(O).name()), options));
    if constexpr (kind != TorchOptimKind::kUnsupported) {
      self->adopt(std::make_unique<O>(self->param_groups(), options));
    }
    return self;
  }

  void step() override;
  std::vector<std::string> state_names() const override;
  std::string type_name() const override { return type_; }
  // The torch optimizer itself (its parameters are the master shards).
  torch::optim::Optimizer& torch_optimizer() { return *optim_; }

 protected:
  void init_state(ShardState& state) override;
  bool can_step_in_backward() const override { return false; }  // it steps every shard at once
  void step_shard(ShardState& state, at::Tensor& param, const at::Tensor& grad, double lr,
                  double weight_decay) override;

 private:
  TorchOptimizer(const std::shared_ptr<FSDPModule>& root, TorchOptimKind kind, std::string type,
                 const torch::optim::OptimizerOptions& defaults);
  std::vector<torch::optim::OptimizerParamGroup> param_groups() const;
  void adopt(std::unique_ptr<torch::optim::Optimizer> optim);
  void push_state();  // ShardState (e.g. just loaded from a checkpoint) -> the torch optimizer's state
  void pull_state();  // the torch optimizer's state -> ShardState (what checkpoints save)
  void apply_group_options();

  TorchOptimKind kind_;
  std::string type_;
  std::unique_ptr<torch::optim::OptimizerOptions> defaults_;
  std::unique_ptr<torch::optim::Optimizer> optim_;
};

}  // namespace fsdp
