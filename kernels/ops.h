// The element-wise operations of the sharded step, one contract for two implementations: CUDA
// kernels (kernels/cuda/) for tensors on a GPU and CPU twins (kernels/cpu/) for everything else.
// Each function below checks its arguments, then dispatches on the device of its tensors; the
// twin and the kernel must agree with the contract stated here, and tests/unit/kernels_test.cpp and
// kernels_blocks_test.cpp hold both to it (twin against plain ATen, kernel against twin).
//
// Common rules for every operation:
//   - tensors are contiguous (any storage offset, so chunk views of a shard are fine) and all on
//     one device; a non-contiguous tensor, a device mix or a wrong dtype throws fsdp::Error naming
//     the operation and the tensor;
//   - outputs never partially overlap another argument (see each op for the exact in-place rule);
//   - float arithmetic is done in fp32 (the ATen "opmath" of fp32, bf16 and fp16), each scalar
//     argument rounded to fp32 once, as ATen does for a Scalar; see Note [Twin numerics];
//   - casts to bf16/fp16 round to nearest even, as at::Tensor::to does;
//   - a CUDA launch runs on the current stream of the tensors' device and is checked: a failed
//     launch throws fsdp::Error with CUDA's message. In a build without CUDA parts a CUDA tensor
//     throws (it cannot normally occur there).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/block_format.h"

namespace fsdp::kernels {

// Hyper-parameters of one AdamW step. `step` counts from 1 (the step being taken).
struct AdamWArgs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;
};

// Fused AdamW (decoupled weight decay) over one flat fp32 shard, in one pass over memory.
// param, grad, exp_avg, exp_avg_sq: fp32, same numel. param_copy: undefined, or bf16/fp16/fp32 of
// the same numel, receiving the updated param cast to its dtype (the next all-gather's input).
// Per element, with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step computed in double:
//   p  = p * (1 - lr*wd)                              (skipped when wd == 0)
//   m  = m + w * (g - m), w = 1 - beta1               (ATen's lerp, one fused multiply-add;
//                                                      g + (w - 1) * (g - m) when w >= 0.5)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//   param_copy = cast(p)
// This is element for element the ATen sequence p.mul_, m.lerp_, v.mul_.addcmul_,
// p.addcdiv_(m, v.sqrt() / sqrt(bc2) + eps, -lr / bc1). grad may not overlap the outputs.
void fused_adamw(const AdamWArgs& args, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& param_copy = at::Tensor());

// Mixed-precision copy-in: dst[i] = cast(src[i] / divide_by) for i < src.numel(), and dst[i] = 0
// for the padding src.numel() <= i < dst.numel(). src and dst: fp32, bf16 or fp16 (any pair);
// dst.numel() >= src.numel(); src and dst do not overlap. Used for the fp32 shard -> param_dtype
// input of the all-gather (divide_by = 1) and for gradients -> reduce_dtype before a sum
// reduce-scatter (divide_by = the pre-divide factor). divide_by == 1 is an exact cast.
void copy_in(const at::Tensor& src, const at::Tensor& dst, double divide_by = 1.0);

struct CopyOutOptions {
  double divide_by = 1.0;   // the post-divide factor of the reduction (1: the reduction averaged)
  bool accumulate = false;  // add into dst instead of overwriting it
};

// Copy-out of a reduced gradient: dst[i] = [dst[i] +] float(src[i]) / divide_by. src: fp32, bf16
// or fp16; dst: fp32 with the same numel. With pre- and post-divide factors a, b (a * b = world
// size) copy_in(.., a) -> sum reduce-scatter -> copy_out(.., {b}) averages; the runtime averages in
// the collective itself (ReduceOp::kAvg) and passes 1. src and dst do not overlap, unless they are
// the same fp32 tensor without accumulate (in place).
void copy_out(const at::Tensor& src, const at::Tensor& dst, const CopyOutOptions& options = {});

// Partial sum of squares for global-norm clipping: out += sum_i double(x[i])^2, accumulated in
// double. x: fp32; out: a one-element fp64 tensor on x's device. The CPU twin sums fixed blocks
// in a fixed order, so its result does not depend on the thread count; the CUDA kernel adds block
// sums atomically (order-dependent in the last bits of a double).
void sum_of_squares(const at::Tensor& x, const at::Tensor& out);

// Scale in place for clipping: x[i] = x[i] * float(factor). x: fp32.
void scale_(const at::Tensor& x, double factor);

// ---- Block quantization of frozen values (Note [Frozen storage] in kernels/cpu/blocks.cpp) ----
// The stored form of n values (n a multiple of kQuantBlock) is block_stored_bytes(f, n) bytes:
// [codes | one fp32 absmax per block]. Per block of 64, absmax = max |x| (NaN if one is NaN), and
//   - kInt8: code = round_half_even((x / d) * 127) as int8, d = absmax if absmax > 0 else 1 (a
//     quotient that rounds outside [-127, 127], or NaN, gets code 0); value = (code / 127) * absmax;
//   - kNF4: inv = 1 / max(absmax, 1e-38f), s = clamp(x * inv, -1, 1), code = the number of
//     midpoints m (kNF4Levels, NF4Table) with !(m >= s); element 2i in the high nibble of byte i,
//     2i + 1 in the low; value = kNF4Levels[code] * absmax.
// Every product and quotient is rounded to fp32 as written, so the CPU twin equals bitsandbytes'
// CPU quantize_4bit (nf4, blocksize 64) and the former ATen expression bit for bit; the CUDA
// kernels do the same IEEE operations (compiled, untested on a GPU: KernelBlocksCuda.*).

// values: fp32, bf16 or fp16, numel a multiple of kQuantBlock; stored: uint8 with
// block_stored_bytes(f, values.numel()) elements; they do not overlap.
void encode_blocks(BlockFormat f, const at::Tensor& values, const at::Tensor& stored);
// out[i] = cast(value i of `stored`): stored as encode_blocks writes it for out.numel() values;
// out: fp32, bf16 or fp16 (cast rounds to nearest even), numel a multiple of kQuantBlock; no overlap.
void decode_blocks(BlockFormat f, const at::Tensor& stored, const at::Tensor& out);

// Whether this build has the CUDA kernels (FSDP_WITH_CUDA); says nothing about a GPU being present.
bool cuda_kernels_built();

}  // namespace fsdp::kernels
