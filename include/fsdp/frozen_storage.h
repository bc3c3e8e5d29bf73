// FrozenStorage: how a frozen parameter's shard is kept (FullyShardOptions::frozen_storage in
// fsdp/options.h). Part of the offload layer, which keeps the shard in its stored form wherever it
// lives (src/frozen/frozen_storage.cpp).
#pragma once

#include <string>

namespace fsdp {

// How a frozen parameter (requires_grad false) keeps its shard. It has no gradient and no
// optimizer state, so it needs no fp32 master either: by default it is stored in the compute
// dtype (MixedPrecisionPolicy::param_dtype). kInt8 and kNF4 quantize it in blocks of 64 elements,
// each with its fp32 absolute maximum: int8 codes q = round((x / absmax) * 127), x = (q / 127) * absmax;
// NF4 as bitsandbytes defines it (the 16 NormalFloat levels times absmax, two codes a byte, first in
// the high nibble). A quantized shard is all-gathered quantized and dequantized into the compute
// dtype (Note [Frozen storage] in kernels/cpu/blocks.cpp). Quantize only frozen parameters
// with values of a Linear's weight's kind; norms and biases lose too much.
enum class FrozenStorage { kParamDtype, kFloat32, kBFloat16, kFloat16, kInt8, kNF4 };
const char* frozen_storage_name(FrozenStorage s);  // "param_dtype", "float32", "bfloat16", "float16", "int8", "nf4"
FrozenStorage parse_frozen_storage(const std::string& name);  // throws ConfigError naming it

}  // namespace fsdp
