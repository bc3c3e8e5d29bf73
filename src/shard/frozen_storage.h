// The stored form of a frozen flat param's shard (FullyShardOptions::frozen_storage): a floating
// dtype, or blocks of kBlock elements quantized to int8 or NF4 with an fp32 absmax each. See
// Note [Frozen storage] in frozen_storage.cpp.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "fsdp/options.h"

namespace fsdp::frozen {

constexpr int64_t kBlock = 64;  // elements per quantization block

bool quantized(FrozenStorage s);
// The dtype of the stored form: the floating dtype, or uint8 (bytes) when quantized. `s` is
// resolved (not kParamDtype).
at::ScalarType stored_dtype(FrozenStorage s);
// Elements of the stored form of `numel` values (a multiple of kBlock when quantized).
int64_t stored_numel(FrozenStorage s, int64_t numel);
// Bytes per value, padding aside: 4, 2, 1 + 4/64 (int8), 0.5 + 4/64 (NF4).
double bytes_per_value(FrozenStorage s);

// The stored form of `values` (1-D, floating, on any device).
at::Tensor encode(FrozenStorage s, const at::Tensor& values);
// Writes the values of `stored` (encode's output, `out.numel()` values) into `out` (1-D,
// floating, any dtype: cast from fp32).
void decode(FrozenStorage s, const at::Tensor& stored, const at::Tensor& out);
// The NF4 levels, as bitsandbytes publishes them.
const float* nf4_levels();

}  // namespace fsdp::frozen
