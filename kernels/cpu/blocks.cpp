// The CPU twins of the block codec (encode_blocks, decode_blocks in kernels/ops.h): one pass over
// the blocks, split across threads with at::parallel_for. Built once, with -ffp-contract=off
// (kernels/CMakeLists.txt), so every product and quotient is rounded to fp32 as written.
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
//     level[q] * absmax. 0.5 + 4/64 bytes per element.
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
#include <cstring>

#include "kernels/cpu/twins.h"

namespace fsdp::kernels::cpu {
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

template <typename In>
void encode_typed(BlockFormat f, const NF4Table& t, const In* values, int64_t blocks, uint8_t* codes, uint8_t* absmax) {
  const int64_t code_bytes = block_code_bytes(f, kQuantBlock);
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    float v[kQuantBlock];
    for (int64_t b = b0; b < b1; ++b) {
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

}  // namespace fsdp::kernels::cpu
