// Run-time choice between the two builds of the CPU twins (Note [Two builds of the twins] in
// twins.cpp): AVX2 when the CPU has AVX2, FMA and F16C, the baseline build otherwise. Decided once.
// Builds for other architectures have the baseline build only (kernels/CMakeLists.txt).
#include "kernels/cpu/twins.h"

namespace fsdp::kernels::cpu {
namespace {

#if FSDP_KERNELS_AVX2
bool use_avx2() {
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return avx2;
}
#define FSDP_TWIN(fn) (use_avx2() ? &AVX2::fn : &DEFAULT::fn)
#else
bool use_avx2() { return false; }
#define FSDP_TWIN(fn) (&DEFAULT::fn)
#endif

}  // namespace

const char* capability() { return use_avx2() ? "avx2" : "default"; }

void adamw(const AdamWScalars& s, float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* param_copy,
           ElemType copy_type, int64_t n) {
  FSDP_TWIN(adamw)(s, param, grad, exp_avg, exp_avg_sq, param_copy, copy_type, n);
}

void copy_in(const void* src, ElemType src_type, void* dst, ElemType dst_type, int64_t n, int64_t dst_n,
             float divide_by) {
  FSDP_TWIN(copy_in)(src, src_type, dst, dst_type, n, dst_n, divide_by);
}

void copy_out(const void* src, ElemType src_type, float* dst, int64_t n, float divide_by, bool accumulate) {
  FSDP_TWIN(copy_out)(src, src_type, dst, n, divide_by, accumulate);
}

double sum_of_squares(const float* x, int64_t n) { return FSDP_TWIN(sum_of_squares)(x, n); }

void scale(float* x, int64_t n, float factor) { FSDP_TWIN(scale)(x, n, factor); }

void encode_blocks(BlockFormat f, const NF4Table& t, const void* values, ElemType type, int64_t blocks, uint8_t* codes,
                   uint8_t* absmax) {
  FSDP_TWIN(encode_blocks)(f, t, values, type, blocks, codes, absmax);
}

void decode_blocks(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax, int64_t blocks,
                   void* out, ElemType type) {
  FSDP_TWIN(decode_blocks)(f, t, codes, absmax, blocks, out, type);
}

#undef FSDP_TWIN

}  // namespace fsdp::kernels::cpu
