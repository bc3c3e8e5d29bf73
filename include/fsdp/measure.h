// fsdp::measure_activations: a user's unit's activations measured by running one copy of it, for
// the planner (fsdp/plan.h) where no formula gives them. Part of the measure layer (src/measure).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "fsdp/plan.h"

namespace fsdp {
// A unit's activations, measured instead of derived: sets `unit.activations` and
// `unit.backward_peak` for a module of any kind. `block` is one copy of the unit, unsharded and
// materialised (one block of the model is enough, built on its own); `forward(batch, seq_len,
// dtype)` runs it on the input the model would give it (requires_grad as in the model: true when
// earlier layers train) and returns its output. The block's parameters decide what autograd saves:
// give them requires_grad as the model will (a LoRA base frozen). When the plan first asks, for
// each dtype, it runs three times on this thread, at `probe_seq_len`, twice and three times that
// with batch 1,
// counting the CPU allocator's bytes: what is alive once the forward returns, less its output,
// is what autograd keeps for backward; the highest point of a backward from a gradient of ones,
// beyond that, is the backward peak (the block's parameter gradients are allocated before it, as
// fsdp's gradient buffer is, which the plan counts apart). What is kept is taken as c + batch x
// (a x seq_len + b x seq_len^2), the three fitted to the three runs: exact for linear layers,
// norms, attention that materialises its scores, and parts the size of a parameter (c). The
// backward's peak, the largest of its moments, as c + batch x a x seq_len through the two larger. A checkpointed unit
// keeps its input, taken as the size of its output (a residual block's).
using UnitForwardFn = std::function<at::Tensor(int64_t batch, int64_t seq_len, at::ScalarType dtype)>;
void measure_activations(UnitShape& unit, std::shared_ptr<torch::nn::Module> block, UnitForwardFn forward,
                         int64_t probe_seq_len = 64);

}  // namespace fsdp
