// The CPU twins of the kernels, on raw pointers whose arguments kernels/ops.cpp has already checked.
// twins.cpp and blocks.cpp are compiled twice: once for the baseline x86-64 instruction set (namespace DEFAULT)
// and once with AVX2 and FMA (namespace AVX2); the functions in namespace fsdp::kernels::cpu pick
// one at run time from the CPU's features. See Note [Two builds of the twins] in twins.cpp.
#pragma once

#include <cstdint>

#include "kernels/block_format.h"
#include "kernels/kernel_args.h"

namespace fsdp::kernels::cpu {

#define FSDP_KERNELS_CPU_DECLARE                                                                                    \
  void adamw(const AdamWScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,             \
             void* param_copy, ElemType copy_type, int64_t n);                                                      \
  void copy_in(const void* src, ElemType src_type, void* dst, ElemType dst_type, int64_t n, int64_t dst_n,          \
               float divide_by);                                                                                    \
  void copy_out(const void* src, ElemType src_type, float* dst, int64_t n, float divide_by, bool accumulate);       \
  double sum_of_squares(const float* x, int64_t n);                                                                 \
  void scale(float* x, int64_t n, float factor);                                                                    \
  /* The block codec (cpu/blocks.cpp, Note [Frozen storage]); absmax: blocks * 4 bytes, fp32, any alignment */      \
  void encode_blocks(BlockFormat f, const NF4Table& t, const void* values, ElemType type, int64_t blocks,           \
                     uint8_t* codes, uint8_t* absmax);                                                              \
  void decode_blocks(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax, int64_t blocks, \
                     void* out, ElemType type);

namespace DEFAULT {
FSDP_KERNELS_CPU_DECLARE
}
namespace AVX2 {
FSDP_KERNELS_CPU_DECLARE
}
FSDP_KERNELS_CPU_DECLARE  // run-time dispatch to one of the above

    // Which build the dispatch uses on this CPU: "avx2" or "default" (benchmarks report it).
    const char*
    capability();

#undef FSDP_KERNELS_CPU_DECLARE

// Elements per task of at::parallel_for: shards below this run on the calling thread, larger ones
// are split in chunks of at least this many (about 128 KiB of each fp32 array).
constexpr int64_t kGrainSize = 32768;

}  // namespace fsdp::kernels::cpu
