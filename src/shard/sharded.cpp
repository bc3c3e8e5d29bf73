// fsdp::Sharded's non-template parts and the check fsdp::call makes on a Sequential: see
// fsdp/sharded.h.
#include "fsdp/sharded.h"

#include <torch/nn/modules/container/sequential.h>

#include "fsdp/errors.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace detail {

ShardedModuleBase::ShardedModuleBase(const std::shared_ptr<torch::nn::Module>& inner)
    : torch::nn::Module(inner ? inner->name() : std::string("fsdp::Sharded")), inner_(inner) {
  if (!inner_) throw ConfigError("fsdp: Sharded got a null module");
  // The block's own names, so the tree (and checkpoints) read as if the block stood here.
  for (const auto& p : inner_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (const auto& c : inner_->named_children()) register_module(c.key(), c.value());
}

void ShardedModuleBase::train(bool on) {
  torch::nn::Module::train(on);
  inner_->train(on);
}

void ShardedModuleBase::pretty_print(std::ostream& stream) const {
  stream << "fsdp::Sharded(";
  inner_->pretty_print(stream);
  stream << ")";
}

void check_container(const torch::nn::Module& module) {
  const auto* seq = dynamic_cast<const torch::nn::SequentialImpl*>(&module);
  if (seq == nullptr) return;
  for (const auto& child : seq->named_children()) {
    if (unit_of(*child.value()) == nullptr) continue;
    if (dynamic_cast<const ShardedModuleBase*>(child.value().get()) != nullptr) continue;
    const ShardedUnit* unit = unit_of(module);
    const std::string seq_path = unit ? unit->path_before_root() : "<root>";
    const std::string path = seq_path == "<root>" ? child.key() : seq_path + "." + child.key();
    throw UsageError("fsdp: Sequential child '" + path + "' (" + child.value()->name() +
                     ") is sharded, but a torch::nn::Sequential calls its children's forward itself, past their "
                     "units; build it with fsdp::Sharded(block) (or net = fsdp::wrap_children<Block>(net)) before "
                     "sharding: docs/WRAPPING.md");
  }
}

}  // namespace detail

std::vector<std::shared_ptr<torch::nn::Module>> sharded_children(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& child : module.children()) {
    if (std::dynamic_pointer_cast<detail::ShardedModuleBase>(child)) out.push_back(child);
  }
  return out;
}

}  // namespace fsdp
