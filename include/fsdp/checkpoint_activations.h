// Activation checkpointing for LibTorch (which has no torch.utils.checkpoint in C++): run a block
// without keeping its activations and recompute them during backward. Works with sharded blocks:
// the recomputation goes through fsdp::call, which gathers the block's parameters again inside
// backward.
//
//   x = fsdp::checkpoint_activations([&](const at::Tensor& h) { return fsdp::call(layer, h); }, x);
//
// `fn` runs again inside backward, after the caller has returned: capture by value what it uses.
// The recomputation must produce the same values as the first run (no dropout or other RNG use
// inside `fn`). `input` need not require grad: the first block of a LoRA model, fed by a frozen
// embedding, is checkpointed like the others, and its adapters get their gradients.
#pragma once

#include <functional>

#include <ATen/core/Tensor.h>

namespace fsdp {

at::Tensor checkpoint_activations(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input);

}  // namespace fsdp
