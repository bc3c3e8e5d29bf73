// TorchOptimizer: a stock element-wise torch::optim optimizer over the flat fp32 master shards.
// Each trainable flat param is one parameter group of one tensor, its master shard; before a step
// its .grad is the collected gradient shard. The optimizer's per-parameter state (exp_avg, sum,
// momentum_buffer, ...) is then shaped like the shard, and ShardState's tensors are the same
// tensors, so checkpoints save and load it as they do fsdp's own optimizers' state.
#include "fsdp/torch_optim.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "fsdp/errors.h"

namespace fsdp {
namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamState;

// The per-element state tensors of one parameter's state, by the names checkpoints use.
std::vector<std::pair<std::string, at::Tensor*>> state_fields(TorchOptimKind kind, OptimizerParamState& st) {
  switch (kind) {
    case TorchOptimKind::kSGD: {
      auto& s = static_cast<torch::optim::SGDParamState&>(st);
      return {{"momentum_buffer", &s.momentum_buffer()}};
    }
    case TorchOptimKind::kAdam: {
      auto& s = static_cast<torch::optim::AdamParamState&>(st);
      return {{"exp_avg", &s.exp_avg()}, {"exp_avg_sq", &s.exp_avg_sq()}, {"max_exp_avg_sq", &s.max_exp_avg_sq()}};
    }
    case TorchOptimKind::kAdamW: {
      auto& s = static_cast<torch::optim::AdamWParamState&>(st);
      return {{"exp_avg", &s.exp_avg()}, {"exp_avg_sq", &s.exp_avg_sq()}, {"max_exp_avg_sq", &s.max_exp_avg_sq()}};
    }
    case TorchOptimKind::kRMSprop: {
      auto& s = static_cast<torch::optim::RMSpropParamState&>(st);
      return {{"square_avg", &s.square_avg()}, {"momentum_buffer", &s.momentum_buffer()}, {"grad_avg", &s.grad_avg()}};
    }
    case TorchOptimKind::kAdagrad: {
      auto& s = static_cast<torch::optim::AdagradParamState&>(st);
      return {{"sum", &s.sum()}};
    }
    case TorchOptimKind::kUnsupported: break;
  }
  return {};
}

// The state's step counter; null for SGD, which keeps none.
int64_t* step_field(TorchOptimKind kind, OptimizerParamState& st) {
  switch (kind) {
    case TorchOptimKind::kAdam: return &static_cast<torch::optim::AdamParamState&>(st).step();
    case TorchOptimKind::kAdamW: return &static_cast<torch::optim::AdamWParamState&>(st).step();
    case TorchOptimKind::kRMSprop: return &static_cast<torch::optim::RMSpropParamState&>(st).step();
    case TorchOptimKind::kAdagrad: return &static_cast<torch::optim::AdagradParamState&>(st).step();
    default: return nullptr;
  }
}

std::unique_ptr<OptimizerParamState> new_state(TorchOptimKind kind) {
  switch (kind) {
    case TorchOptimKind::kSGD: return std::make_unique<torch::optim::SGDParamState>();
    case TorchOptimKind::kAdam: return std::make_unique<torch::optim::AdamParamState>();
    case TorchOptimKind::kAdamW: return std::make_unique<torch::optim::AdamWParamState>();
    case TorchOptimKind::kRMSprop: return std::make_unique<torch::optim::RMSpropParamState>();
    case TorchOptimKind::kAdagrad: return std::make_unique<torch::optim::AdagradParamState>();
    default: return nullptr;
  }
}

double& weight_decay_of(TorchOptimKind kind, OptimizerOptions& o) {
  switch (kind) {
    case TorchOptimKind::kSGD: return static_cast<torch::optim::SGDOptions&>(o).weight_decay();
    case TorchOptimKind::kAdam: return static_cast<torch::optim::AdamOptions&>(o).weight_decay();
    case TorchOptimKind::kAdamW: return static_cast<torch::optim::AdamWOptions&>(o).weight_decay();
    case TorchOptimKind::kRMSprop: return static_cast<torch::optim::RMSpropOptions&>(o).weight_decay();
    case TorchOptimKind::kAdagrad: return static_cast<torch::optim::AdagradOptions&>(o).weight_decay();
    default: break;
  }
  throw ConfigError("fsdp: internal: weight decay of an unsupported optimizer");
}

}  // namespace

TorchOptimizer::TorchOptimizer(const std::shared_ptr<FSDPModule>& root, TorchOptimKind kind, std::string type,
                               const OptimizerOptions& defaults)
    : ShardedOptimizer(root), kind_(kind), type_(std::move(type)), defaults_(defaults.clone()) {
  if (kind_ == TorchOptimKind::kUnsupported) {
    throw ConfigError("fsdp: " + type_ +
                      " cannot step a sharded model: each rank holds only a flat shard of every parameter, so "
                      "only element-wise optimizers work (torch::optim::SGD, Adam, AdamW, RMSprop, Adagrad, or "
                      "fsdp::AdamW / fsdp::SGD); one that needs whole parameters or the whole gradient (LBFGS's "
                      "line search, a matrix preconditioner) would compute something else. Use one of those");
  }
  for (const auto& s : states()) {
    if (state_offloaded(s)) {
      throw ConfigError("fsdp: " + type_ + " keeps its state in memory, but unit '" + s.tag +
                        "' offloads optimizer state; set offload.optimizer_state to \"none\" or use fsdp::AdamW");
    }
  }
  set_lr(defaults.get_lr());
}

std::vector<torch::optim::OptimizerParamGroup> TorchOptimizer::param_groups() const {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& s : const_cast<TorchOptimizer*>(this)->states()) {
    groups.emplace_back(std::vector<at::Tensor>{master_shard(s)}, defaults_->clone());
  }
  return groups;
}

void TorchOptimizer::adopt(std::unique_ptr<torch::optim::Optimizer> optim) {
  optim_ = std::move(optim);
  apply_group_options();
  pull_state();  // Adagrad creates its state at construction
}

std::vector<std::string> TorchOptimizer::state_names() const {
  switch (kind_) {
    case TorchOptimKind::kSGD:
      if (static_cast<const torch::optim::SGDOptions&>(*defaults_).momentum() == 0) return {};
      return {"momentum_buffer"};
    case TorchOptimKind::kAdam:
    case TorchOptimKind::kAdamW: {
      const bool ams = kind_ == TorchOptimKind::kAdam
                           ? static_cast<const torch::optim::AdamOptions&>(*defaults_).amsgrad()
                           : static_cast<const torch::optim::AdamWOptions&>(*defaults_).amsgrad();
      if (ams) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
      return {"exp_avg", "exp_avg_sq"};
    }
    case TorchOptimKind::kRMSprop: {
      const auto& o = static_cast<const torch::optim::RMSpropOptions&>(*defaults_);
      std::vector<std::string> names{"square_avg"};
      if (o.momentum() > 0) names.push_back("momentum_buffer");
      if (o.centered()) names.push_back("grad_avg");
      return names;
    }
    case TorchOptimKind::kAdagrad: return {"sum"};
    case TorchOptimKind::kUnsupported: break;
  }
  return {};
}

void TorchOptimizer::init_state(ShardState& s) {
  for (const auto& name : state_names()) s.tensors[name] = at::zeros_like(master_shard(s));
}

void TorchOptimizer::step_shard(ShardState& s, at::Tensor&, const at::Tensor&, double, double) {
  throw ConfigError("fsdp: internal: " + type_ + " steps every shard at once (" + s.tag + ")");
}

// The lr (times the group's lr_scale) and weight decay (the group's, else the options') of
// every parameter group, from fsdp's settings.
void TorchOptimizer::apply_group_options() {
  auto& groups = optim_->param_groups();
  auto& all = states();
  for (size_t i = 0; i < all.size(); ++i) {
    const int group = group_of(all[i]);
    auto& o = groups[i].options();
    o.set_lr(group_lr(group));
    weight_decay_of(kind_, o) = group_weight_decay_override(group).value_or(weight_decay_of(kind_, *defaults_));
  }
}

void TorchOptimizer::push_state() {
  auto& torch_state = optim_->state();
  for (auto& s : states()) {
    void* key = master_shard(s).unsafeGetTensorImpl();
    auto it = torch_state.find(key);
    if (s.tensors.empty()) {
      // Never stepped (or loaded as never stepped): start afresh, as a new optimizer would.
      if (it == torch_state.end()) continue;
      const int64_t* step = step_field(kind_, *it->second);
      if (kind_ == TorchOptimKind::kAdagrad && step != nullptr && *step == 0) continue;  // its initial state
      torch_state.erase(it);
      if (kind_ == TorchOptimKind::kAdagrad) {
        auto fresh = new_state(kind_);
        static_cast<torch::optim::AdagradParamState&>(*fresh).sum(at::full_like(
            master_shard(s), static_cast<torch::optim::AdagradOptions&>(*defaults_).initial_accumulator_value()));
        torch_state[key] = std::move(fresh);
      }
      continue;
    }
    if (it == torch_state.end()) it = torch_state.emplace(key, new_state(kind_)).first;
    for (auto& [name, field] : state_fields(kind_, *it->second)) {
      auto found = s.tensors.find(name);
      if (found != s.tensors.end()) *field = found->second;
    }
    if (int64_t* step = step_field(kind_, *it->second)) *step = s.step;
  }
}

void TorchOptimizer::pull_state() {
  auto& torch_state = optim_->state();
  for (auto& s : states()) {
    auto it = torch_state.find(master_shard(s).unsafeGetTensorImpl());
    if (it == torch_state.end()) continue;
    for (auto& [name, field] : state_fields(kind_, *it->second)) {
      if (field->defined()) s.tensors[name] = *field;
    }
    if (const int64_t* step = step_field(kind_, *it->second)) s.step = *step;
  }
}

void TorchOptimizer::step() {
  c10::NoGradGuard no_grad;
  // Collect the last reductions first (backward finished them last), once every gradient is known
  // to be whole: a refusal must come before any state changes.
  auto& all = states();
  check_gradients_for_step();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    at::Tensor grad = collect_grad(*it);
    master_shard(*it).mutable_grad() = grad;  // undefined: the optimizer skips the shard
    if (grad.defined() && kind_ == TorchOptimKind::kSGD) ++it->step;
  }
  push_state();
  apply_group_options();
  optim_->step();
  pull_state();
}

}  // namespace fsdp
