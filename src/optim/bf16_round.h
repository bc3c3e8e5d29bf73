// Stochastic rounding of fp32 values to bf16, with random bits that are a function of where the
// value is (a seed and the element's index), not of a generator's state: the same inputs round the
// same way on every run and whatever chunks the caller splits them into. Used for AdamW's moments
// in bf16 (Note [AdamW's moments in bfloat16] in optim.cpp).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fsdp {

// The seed of one state tensor's rounding in one step: a hash of the flat param's index, the step
// and which of its state tensors (`slot`).
uint32_t bf16_round_seed(size_t flat_index, int64_t step, int slot);

// The 16 random bits of element `index` under `seed` (a 32-bit integer hash of index + seed).
uint32_t bf16_round_bits(uint32_t seed, int64_t index);

// dst[i] = src[i] rounded to bf16: towards zero or away from it, away with probability equal to the
// fraction of bf16's last place that truncation drops (so the expected value is src[i]). Element i
// takes bf16_round_bits(seed, first + i); its bits added to the fp32 pattern carry into bf16's last
// place exactly when they exceed what truncation drops. NaN stays NaN, infinities stay infinite.
// src: contiguous fp32; dst: bf16 of the same numel on the same device (a contiguous view is
// fine). CPU tensors take a threaded loop; others the same arithmetic as ATen integer operations.
void round_to_bf16_stochastic(const at::Tensor& src, const at::Tensor& dst, uint32_t seed, int64_t first);

namespace testing {
// The ATen-operations path of round_to_bf16_stochastic (what a device tensor takes), run on any
// device: the tests check that it equals the CPU loop bit for bit.
void round_to_bf16_stochastic_ops(const at::Tensor& src, const at::Tensor& dst, uint32_t seed, int64_t first);
}  // namespace testing

}  // namespace fsdp
