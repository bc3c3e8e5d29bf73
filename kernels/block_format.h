// The block-quantized form of a tensor (Note [Frozen storage] in kernels/cpu/blocks.cpp): plain
// constants shared by kernels/ops.h (which users include), the CPU twins and the CUDA kernels. No
// ATen or CUDA includes, so nvcc compiles the .cu files that include it quickly.
#pragma once

#include <cstdint>

namespace fsdp::kernels {

// The codes of a block-quantized tensor: one int8 per value, or one NF4 nibble per value.
enum class BlockFormat : int { kInt8, kNF4 };

constexpr int64_t kQuantBlock = 64;  // values per block, each block with one fp32 absmax

// bitsandbytes' NF4 levels (get_4bit_type("nf4")), ascending, as fp32.
inline constexpr float kNF4Levels[16] = {-1.0f,
                                         -0.6961928009986877f,
                                         -0.5250730514526367f,
                                         -0.39491748809814453f,
                                         -0.28444138169288635f,
                                         -0.18477343022823334f,
                                         -0.09105003625154495f,
                                         0.0f,
                                         0.07958029955625534f,
                                         0.16093020141124725f,
                                         0.24611230194568634f,
                                         0.33791524171829224f,
                                         0.44070982933044434f,
                                         0.5626170039176941f,
                                         0.7229568362236023f,
                                         1.0f};

// Bytes of the codes of `numel` values (numel a multiple of kQuantBlock).
constexpr int64_t block_code_bytes(BlockFormat f, int64_t numel) { return f == BlockFormat::kNF4 ? numel / 2 : numel; }
// Bytes of the whole stored form: the codes, then one fp32 absmax per block.
constexpr int64_t block_stored_bytes(BlockFormat f, int64_t numel) {
  return block_code_bytes(f, numel) + numel / kQuantBlock * static_cast<int64_t>(sizeof(float));
}

// The NF4 levels and the fp32 midpoints between consecutive ones, computed once on the host
// (kernels/ops.cpp) and handed by value to the twin and the kernel alike.
struct NF4Table {
  float levels[16];
  float mids[15];  // (levels[j] + levels[j + 1]) / 2, each rounded to fp32
};
const NF4Table& nf4_table();  // built once (kernels/ops.cpp)

}  // namespace fsdp::kernels
