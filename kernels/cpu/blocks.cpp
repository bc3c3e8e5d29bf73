// The CPU twins of the block codec (encode_blocks, decode_blocks in kernels/ops.h): one pass over
// the blocks, split across threads with at::parallel_for. Built like twins.cpp, once per instruction
// set (Note [Two builds of the twins]), always with -ffp-contract=off (kernels/CMakeLists.txt), so
// every product and quotient is rounded to fp32 as written. The AVX2 build runs NF4 eight values
// to an instruction (Note [NF4 eight at a time]); int8, and any NF4 block holding a NaN, take the
// scalar loops, which are the definition.
//
// Note [Frozen storage]
// A frozen flat param (no gradient, no optimizer state) keeps its shard in a stored form instead
// of an fp32 master (FullyShardOptions::frozen_storage, mapped onto this codec by
// src/shard/frozen_storage.cpp): a floating dtype (the compute dtype by default; a plain cast), or
// quantized. Quantized shards are cut into blocks of kQuantBlock (64) elements. A flat param that
// is quantized starts each parameter at a multiple of 64 in its flat buffer (zeros between), so a
// parameter's blocks are those it would have quantized alone, and pads the buffer to a multiple of
// world * 64, so blocks never straddle ranks (src/shard/flat_param.cpp). The stored form of n
// elements is one byte tensor, [codes | absmax as fp32 bytes], n / 64 absmax values after the codes:
//   - int8: q = round_half_even((x / absmax) * 127) as int8 (0 for a block of zeros);
//     value = (q / 127) * absmax. Dividing first keeps every step finite for any absmax, denormal
//     or FLT_MAX, and q = +-127 gives back +-absmax exactly. 1 + 4/64 bytes per element.
//   - NF4 (bitsandbytes' quantize_4bit with quant_type "nf4", blocksize 64, without double
//     quantization): inv = 1 / max(absmax, 1e-38), s = clamp(x * inv, -1, 1), q = the number of
//     midpoints between consecutive levels that are below s (so a value on a midpoint takes the
//     lower level); element 2i in the high nibble of byte i, 2i + 1 in the low; value =
//     level[q] * absmax. 0.5 + 4/64 bytes per element. A bitsandbytes 4-bit save (NF4, blocks of
//     64) holds this form: the import copies its codes as they are and decodes a double-quantized
//     absmax to fp32 once (Note [bitsandbytes 4-bit weights] in src/bnb/bnb4.cpp).
// Every product is rounded to fp32 as written, so a numpy script of the same formulas (and
// bitsandbytes on CPU, for NF4) gives the same codes and values bit for bit
// (tests/interop/frozen_storage_test.py); the twins below are that definition, equal bit for bit to
// the ATen expression that preceded them, and the CUDA kernels (kernels/cuda/blocks.cu: compiled,
// untested on a GPU) do the same IEEE fp32 operations. A non-finite value is not meaningful to
// quantize; what it gives is fixed anyway (kernels/ops.h: NaN propagates into the absmax, so the
// block decodes to NaN). The all-gather moves the stored form and each rank decodes the gathered
// bytes into the compute-dtype buffer.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cpu/twins.h"

#ifdef CPU_CAPABILITY_AVX2
#include <immintrin.h>
#endif

namespace fsdp::kernels::cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kGrainBlocks = 64;  // blocks per task of at::parallel_for (4096 values)

// One block's values as fp32 (widening is exact) and its absmax, NaN-propagating like at::amax.
template <typename In>
float widen_block(const In* x, float* v) {
  float am = 0.0f;
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    v[i] = static_cast<float>(x[i]);
    const float a = std::fabs(v[i]);
    if (!std::isnan(am) && (a > am || std::isnan(a))) am = a;
  }
  return am;
}

uint8_t int8_code(float unit) {
  const float r = std::nearbyint(unit * 127.0f);  // round half to even (the default rounding mode)
  const int8_t q = r >= -127.0f && r <= 127.0f ? static_cast<int8_t>(r) : int8_t{0};
  return static_cast<uint8_t>(q);
}

uint8_t nf4_code(float s, const NF4Table& t) {
  s = std::min(std::max(s, -1.0f), 1.0f);  // NaN stays NaN (and counts every midpoint)
  uint8_t q = 0;
  for (int j = 0; j < 15; ++j) q += !(t.mids[j] >= s);
  return q;
}

void encode_block(BlockFormat f, const NF4Table& t, const float* v, float am, uint8_t* codes) {
  if (f == BlockFormat::kInt8) {
    const float d = am > 0.0f ? am : 1.0f;
    for (int64_t i = 0; i < kQuantBlock; ++i) codes[i] = int8_code(v[i] / d);
    return;
  }
  const float inv = 1.0f / (std::isnan(am) ? am : std::max(am, 1e-38f));
  for (int64_t i = 0; i < kQuantBlock / 2; ++i) {
    codes[i] = static_cast<uint8_t>((nf4_code(v[2 * i] * inv, t) << 4) | nf4_code(v[2 * i + 1] * inv, t));
  }
}

#ifdef CPU_CAPABILITY_AVX2
// Note [NF4 eight at a time]
// The AVX2 build encodes and decodes NF4 eight values to an instruction, with the scalar loops'
// arithmetic, so its codes and values equal theirs bit for bit (KernelBlocks.Avx2BuildMatchesDefault):
//   - encode: the absmax of a block without NaN is the largest |x| in any order (a maximum is
//     exact); x * inv is the same fp32 product; the code counts the midpoints m with !(m >= s),
//     fifteen compares. The clamp to [-1, 1] of the scalar loop changes no count, since every
//     midpoint lies strictly inside it. A block holding a NaN goes to the scalar loop.
//   - decode: a level is looked up with two in-register permutes of eight levels each, multiplied
//     by the absmax, and rounded to bf16 the way c10::BFloat16 does (to nearest, ties to even) or to
//     fp16 by the F16C instruction (IEEE, to nearest even, denormals kept). A block whose absmax is
//     not finite (NaN, or infinite, which makes level 0 a NaN) goes to the scalar loop.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is fp32's upper half: widening is a shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // v holds no NaN (its block's absmax is finite)
  const __m256i b = _mm256_castps_si256(v);
  const __m256i bias =
      _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One NF4 block of 64 values: its codes and absmax, or false (nothing written) when it holds a NaN.
template <typename In>
bool encode_nf4_block8(const __m256* mids, const In* x, uint8_t* codes, uint8_t* absmax) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[8];
  __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int k = 0; k < 8; ++k) {
    v[k] = load8(x + 8 * k);
    top = _mm256_max_ps(top, _mm256_and_ps(v[k], abs_mask));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) return false;
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float am = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(1.0f / std::max(am, 1e-38f));
  for (int k = 0; k < 8; k += 2) {  // 16 values, 8 bytes of codes
    const __m256 s0 = _mm256_mul_ps(v[k], inv), s1 = _mm256_mul_ps(v[k + 1], inv);
    __m256i q0 = _mm256_setzero_si256(), q1 = _mm256_setzero_si256();
    for (int j = 0; j < 15; ++j) {  // a true compare is all ones, -1: subtracting it counts it
      q0 = _mm256_sub_epi32(q0, _mm256_castps_si256(_mm256_cmp_ps(mids[j], s0, _CMP_NGE_UQ)));
      q1 = _mm256_sub_epi32(q1, _mm256_castps_si256(_mm256_cmp_ps(mids[j], s1, _CMP_NGE_UQ)));
    }
    // 16 codes as bytes in order, then element 2i into the high nibble of byte i, 2i + 1 the low.
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
    const __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    const __m128i even = _mm_and_si128(b, _mm_set1_epi16(0x00ff)), odd = _mm_srli_epi16(b, 8);
    const __m128i packed = _mm_or_si128(_mm_slli_epi16(even, 4), odd);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + 4 * k), _mm_packus_epi16(packed, packed));
  }
  std::memcpy(absmax, &am, sizeof(float));
  return true;
}

template <typename Out>
void decode_nf4_block8(const NF4Table& t, const uint8_t* codes, float am, Out* out) {
  const __m256 low = _mm256_loadu_ps(t.levels), high = _mm256_loadu_ps(t.levels + 8);
  const __m256 scale = _mm256_set1_ps(am);
  for (int g = 0; g < 4; ++g) {  // 8 bytes of codes, 16 values
    const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * g)));
    // Each 16-bit lane (c >> 4) | (c & 15) << 8: the bytes are the codes in the values' order.
    const __m128i idx = _mm_or_si128(_mm_srli_epi16(c, 4), _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(15)), 8));
    for (int half = 0; half < 2; ++half) {
      const __m256i i = _mm256_cvtepu8_epi32(half == 0 ? idx : _mm_srli_si128(idx, 8));
      const __m256 level = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, i), _mm256_permutevar8x32_ps(high, i),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));  // bit 3 picks the half
      store8(out + 16 * g + 8 * half, _mm256_mul_ps(level, scale));
    }
  }
}

// Note [NF4 sixteen at a time]
// Where the CPU has AVX-512F (checked once at run time; the AVX2 build compiles this function for
// it alone), the decode looks up sixteen levels with one permute of all sixteen, multiplies by the
// absmax and rounds to bf16 with the same integer steps as store8, so its values equal the eight-wide
// and the scalar loops' bit for bit (KernelBlocks.DispatchedBuildMatchesBaseline). It does a third
// of the eight-wide path's work per value: the decode was 17-24% of a QLoRA step at 8B and 70B.
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_* values, which -Wuninitialized flags.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <typename Out>
__attribute__((target("avx512f"))) void decode_nf4_block16(const NF4Table& t, const uint8_t* codes, float am,
                                                           Out* out) {
  const __m512 levels = _mm512_loadu_ps(t.levels), scale = _mm512_set1_ps(am);
  for (int g = 0; g < 4; ++g) {  // 8 bytes of codes, 16 values
    const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * g)));
    const __m128i idx = _mm_or_si128(_mm_srli_epi16(c, 4), _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(15)), 8));
    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), levels), scale);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_storeu_ps(out + 16 * g, v);
    } else if constexpr (std::is_same_v<Out, c10::Half>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * g),
                          _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {  // bf16: to nearest, ties to even, as store8 (v holds no NaN: the absmax is finite)
      const __m512i b = _mm512_castps_si512(v);
      const __m512i bias =
          _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * g),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, bias), 16)));
    }
  }
}

#pragma GCC diagnostic pop

// FSDP_NF4_AVX512=0 keeps the eight-wide decode (the same values; for CPUs whose clock drops
// under 512-bit instructions, and to measure the one against the other).
bool has_avx512f() {
  static const bool yes = __builtin_cpu_supports("avx512f") && !(std::getenv("FSDP_NF4_AVX512") != nullptr &&
                                                                 std::string(std::getenv("FSDP_NF4_AVX512")) == "0");
  return yes;
}
#endif

template <typename In>
void encode_typed(BlockFormat f, const NF4Table& t, const In* values, int64_t blocks, uint8_t* codes, uint8_t* absmax) {
  const int64_t code_bytes = block_code_bytes(f, kQuantBlock);
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
#ifdef CPU_CAPABILITY_AVX2
    __m256 mids[15];
    for (int j = 0; j < 15; ++j) mids[j] = _mm256_set1_ps(t.mids[j]);
#endif
    float v[kQuantBlock];
    for (int64_t b = b0; b < b1; ++b) {
#ifdef CPU_CAPABILITY_AVX2
      if (f == BlockFormat::kNF4 &&
          encode_nf4_block8(mids, values + b * kQuantBlock, codes + b * code_bytes, absmax + b * 4))
        continue;
#endif
      const float am = widen_block(values + b * kQuantBlock, v);
      encode_block(f, t, v, am, codes + b * code_bytes);
      std::memcpy(absmax + b * 4, &am, sizeof(float));
    }
  });
}

// The decode as one pass, block by block over the threads: a division by 127 then a product for
// int8, a product for NF4, rounded to the output dtype as a cast does.
template <typename Out>
void decode_typed(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax, int64_t blocks,
                  Out* out) {
#ifdef CPU_CAPABILITY_AVX2
  const bool wide = has_avx512f();
#endif
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float am;
      std::memcpy(&am, absmax + b * 4, sizeof(float));
      Out* o = out + b * kQuantBlock;
      if (f == BlockFormat::kInt8) {
        const auto* q = reinterpret_cast<const int8_t*>(codes) + b * kQuantBlock;
        for (int64_t i = 0; i < kQuantBlock; ++i) o[i] = static_cast<Out>((static_cast<float>(q[i]) / 127.0f) * am);
      } else {
        const uint8_t* q = codes + b * (kQuantBlock / 2);
#ifdef CPU_CAPABILITY_AVX2
        if (std::isfinite(am)) {  // an infinite absmax makes a NaN of level 0
          if (wide) {
            decode_nf4_block16(t, q, am, o);
          } else {
            decode_nf4_block8(t, q, am, o);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < kQuantBlock / 2; ++i) {
          o[2 * i] = static_cast<Out>(t.levels[q[i] >> 4] * am);
          o[2 * i + 1] = static_cast<Out>(t.levels[q[i] & 15] * am);
        }
      }
    }
  });
}

}  // namespace

void encode_blocks(BlockFormat f, const NF4Table& t, const void* values, ElemType type, int64_t blocks, uint8_t* codes,
                   uint8_t* absmax) {
  switch (type) {
    case ElemType::kFloat32: return encode_typed(f, t, static_cast<const float*>(values), blocks, codes, absmax);
    case ElemType::kBFloat16:
      return encode_typed(f, t, static_cast<const c10::BFloat16*>(values), blocks, codes, absmax);
    case ElemType::kFloat16: return encode_typed(f, t, static_cast<const c10::Half*>(values), blocks, codes, absmax);
  }
}

void decode_blocks(BlockFormat f, const NF4Table& t, const uint8_t* codes, const uint8_t* absmax, int64_t blocks,
                   void* out, ElemType type) {
  switch (type) {
    case ElemType::kFloat32: return decode_typed(f, t, codes, absmax, blocks, static_cast<float*>(out));
    case ElemType::kBFloat16: return decode_typed(f, t, codes, absmax, blocks, static_cast<c10::BFloat16*>(out));
    case ElemType::kFloat16: return decode_typed(f, t, codes, absmax, blocks, static_cast<c10::Half*>(out));
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fsdp::kernels::cpu
