// Reentrant activation checkpointing as a custom autograd Function: forward runs the block with
// grad off and keeps only its input; backward re-runs it with grad on and back-propagates through
// the recomputed graph (a nested backward, in which the sharded units' hooks run as usual).
#include "fsdp/checkpoint_activations.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

namespace fsdp {
namespace {

struct BlockFn : torch::CustomClassHolder {
  explicit BlockFn(std::function<at::Tensor(const at::Tensor&)> f) : fn(std::move(f)) {}
  std::function<at::Tensor(const at::Tensor&)> fn;
};

// Inputs: the block's input, and an anchor: an empty leaf that requires grad when the input does
// not (a LoRA model's first block, fed by a frozen embedding), so that autograd records this node
// and calls its backward, which carries the gradient into the block's trainable parameters.
class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& anchor,
                            const c10::intrusive_ptr<BlockFn>& block) {
    (void)anchor;
    ctx->saved_data["block"] = c10::IValue::make_capsule(block);
    ctx->save_for_backward({input});
    return block->fn(input);  // custom Function forwards run with grad off
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto block = c10::static_intrusive_pointer_cast<BlockFn>(ctx->saved_data["block"].toCapsule());
    at::Tensor input = ctx->get_saved_variables()[0];
    at::Tensor x = input.detach().requires_grad_(input.requires_grad());
    at::Tensor out;
    {
      c10::AutoGradMode grad_on(true);
      out = block->fn(x);
    }
    // A block with nothing trainable, fed by an input without grad: nothing to carry back.
    if (out.requires_grad()) torch::autograd::backward({out}, {grad_outputs[0]});
    return {x.requires_grad() ? x.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor checkpoint_activations(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input) {
  if (!c10::GradMode::is_enabled()) return fn(input);
  // Autograd records every tensor input, so the anchor is always a (0-element) tensor.
  const at::Tensor anchor = at::empty({0}, input.options().dtype(at::kFloat)).requires_grad_(!input.requires_grad());
  return CheckpointFunction::apply(input, anchor, c10::make_intrusive<BlockFn>(fn));
}

}  // namespace fsdp
