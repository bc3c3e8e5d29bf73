// The streamed optimizer step: one flat param's update applied chunk by chunk, so that disk-tier
// tensors are mapped only a few chunks at a time. Each chunk runs the optimizer's own
// step_shard on views, so the arithmetic is the optimizer's, unchanged.
//
// Note [Bitwise-equal chunks]
// ATen's element-wise CPU kernels run a vectorised loop over blocks of 2 x Vectorized<float>::size()
// elements (16 with AVX2, 32 with AVX-512) and a scalar loop over the rest. A chunk that starts at
// a multiple of 64 elements and, unless it is the last, spans a multiple of 64 puts every element
// in the same kind of loop as the whole-tensor op does, so the streamed step equals the
// whole-tensor step bit for bit (fp32; one intra-op thread, or kernels whose vector and scalar
// paths agree, as AdamW's and SGD's do). Chunks here are multiples of 1024 elements.
#pragma once

#include <functional>

#include <ATen/core/Tensor.h>

#include "fsdp/optim.h"

namespace fsdp::offload {

using ShardStepFn = std::function<void(ShardState& chunk, at::Tensor& param, const at::Tensor& grad)>;

// Whether any of the step's tensors (param, grad, state) lives in the disk tier.
bool needs_streaming(const ShardState& s, const at::Tensor& param, const at::Tensor& grad);

// Runs `step` over chunks of (param, grad, every state tensor) with read-ahead of the next chunk
// and write-behind of the last one (see Note [Disk tier residency]). Throws ConfigError when
// `step` replaces a state tensor instead of updating it in place (such an optimizer's state
// cannot be streamed).
void step_in_chunks(ShardState& s, at::Tensor& param, const at::Tensor& grad, const ShardStepFn& step);

}  // namespace fsdp::offload
