// The stored form of a frozen flat param's shard (FullyShardOptions::frozen_storage): a floating
// dtype, or blocks of kBlock elements quantized to int8 or NF4 with an fp32 absmax each, by the
// kernels' block codec (kernels/ops.h: encode_blocks, decode_blocks). See Note [Frozen storage] in
// kernels/cpu/blocks.cpp. This header includes no kernels header, so the layers above shard can use it.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "fsdp/frozen_storage.h"

namespace fsdp::frozen {

constexpr int64_t kBlock = 64;  // elements per quantization block (kernels::kQuantBlock)

bool quantized(FrozenStorage s);
// The dtype of the stored form: the floating dtype, or uint8 (bytes) when quantized. `s` is
// resolved (not kParamDtype).
at::ScalarType stored_dtype(FrozenStorage s);
// Elements of the stored form of `numel` values (a multiple of kBlock when quantized).
int64_t stored_numel(FrozenStorage s, int64_t numel);
// Bytes per value, padding aside: 4, 2, 1 + 4/64 (int8), 0.5 + 4/64 (NF4).
double bytes_per_value(FrozenStorage s);

// The stored form of `values` (floating, numel a multiple of kBlock when quantized, on any device:
// the kernels run on the CPU and CUDA, other devices go through the CPU).
at::Tensor encode(FrozenStorage s, const at::Tensor& values);
// The same, written into `stored` (encode's dtype and size for values.numel(), on any device), so
// that no second stored form exists beside it.
void encode_into(FrozenStorage s, const at::Tensor& values, const at::Tensor& stored);
// Writes the stored form of elements [begin, begin + values.numel()) of a shard of `numel` values
// into `stored` (that shard's stored form, on the CPU or a device), leaving the rest alone:
// `begin` starts a block, and a last block that `values` ends inside is completed with zeros.
// `values` of dtype uint8 are whole blocks already in NF4's stored form ([codes | absmax as fp32
// bytes], as bitsandbytes keeps them: bnb/bnb4.h): copied as they are into an NF4 stored form,
// decoded and stored again into any other.
void encode_range(FrozenStorage s, const at::Tensor& values, const at::Tensor& stored, int64_t numel, int64_t begin);
// Writes the values of `stored` (encode's output, `out.numel()` values) into `out` (floating, any
// dtype: cast from fp32; fp32, bf16 and fp16 contiguous outputs are written in one pass).
void decode(FrozenStorage s, const at::Tensor& stored, const at::Tensor& out);
// The NF4 levels, as bitsandbytes publishes them.
const float* nf4_levels();

}  // namespace fsdp::frozen
