// Note [Frozen storage]
// A frozen flat param (no gradient, no optimizer state) keeps its shard in a stored form instead
// of an fp32 master: a floating dtype (the compute dtype by default), or quantized. Quantized
// shards are cut into blocks of kBlock (64) elements. A flat param that is quantized starts each
// parameter at a multiple of 64 in its flat buffer (zeros between), so a parameter's blocks are
// those it would have quantized alone, and pads the buffer to a multiple of world * 64, so
// blocks never straddle ranks. The stored form of n
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
// (tests/interop/frozen_storage_test.py). The all-gather moves the stored form and each rank
// decodes the gathered bytes into the compute-dtype buffer.
#include "shard/frozen_storage.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "fsdp/errors.h"

namespace fsdp::frozen {
namespace {

// bitsandbytes' NF4 levels (get_4bit_type("nf4")), as fp32.
const float kNF4[16] = {-1.0f,
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

int64_t code_bytes(FrozenStorage s, int64_t numel) { return s == FrozenStorage::kNF4 ? numel / 2 : numel; }

at::Tensor levels(const at::Device& device) {
  return at::from_blob(const_cast<float*>(kNF4), {16}, at::kFloat).to(device);
}

void check_blocks(int64_t numel) {
  if (numel % kBlock != 0) {
    throw ConfigError("fsdp: a quantized frozen shard of " + std::to_string(numel) +
                      " elements is not a whole number of " + std::to_string(kBlock) + "-element blocks");
  }
}

}  // namespace

bool quantized(FrozenStorage s) { return s == FrozenStorage::kInt8 || s == FrozenStorage::kNF4; }

at::ScalarType stored_dtype(FrozenStorage s) {
  switch (s) {
    case FrozenStorage::kFloat32: return at::kFloat;
    case FrozenStorage::kBFloat16: return at::kBFloat16;
    case FrozenStorage::kFloat16: return at::kHalf;
    case FrozenStorage::kInt8:
    case FrozenStorage::kNF4: return at::kByte;
    case FrozenStorage::kParamDtype: break;
  }
  throw ConfigError("fsdp: frozen storage param_dtype has no stored dtype until it is resolved");
}

int64_t stored_numel(FrozenStorage s, int64_t numel) {
  if (!quantized(s)) return numel;
  return code_bytes(s, numel) + numel / kBlock * static_cast<int64_t>(sizeof(float));
}

double bytes_per_value(FrozenStorage s) {
  switch (s) {
    case FrozenStorage::kInt8: return 1.0 + 4.0 / kBlock;
    case FrozenStorage::kNF4: return 0.5 + 4.0 / kBlock;
    case FrozenStorage::kBFloat16:
    case FrozenStorage::kFloat16: return 2.0;
    default: return 4.0;
  }
}

const float* nf4_levels() { return kNF4; }

at::Tensor encode(FrozenStorage s, const at::Tensor& values) {
  if (!quantized(s)) return values.to(stored_dtype(s)).contiguous();
  const int64_t n = values.numel();
  check_blocks(n);
  const at::Tensor blocks = values.to(at::kFloat).reshape({-1, kBlock});
  const at::Tensor absmax = blocks.abs().amax(1);
  const at::Tensor safe = absmax.clamp_min(1e-38);
  at::Tensor codes;
  if (s == FrozenStorage::kInt8) {
    const at::Tensor unit = blocks / at::where(absmax > 0, absmax, at::ones_like(absmax)).unsqueeze(1);
    codes = (unit * at::full({1}, 127.0f, absmax.options())).round().to(at::kChar).view(at::kByte).reshape({-1});
  } else {
    const at::Tensor inv = at::full({1}, 1.0f, absmax.options()) / safe;
    const at::Tensor scaled = (blocks * inv.unsqueeze(1)).clamp(-1, 1).reshape({-1});
    const at::Tensor lv = levels(values.device());
    const at::Tensor mid = (lv.narrow(0, 0, 15) + lv.narrow(0, 1, 15)) / 2;
    const at::Tensor q = at::bucketize(scaled, mid, /*out_int32=*/true, /*right=*/false).to(at::kByte);
    codes = at::bitwise_or(at::bitwise_left_shift(q.slice(0, 0, n, 2), 4), q.slice(0, 1, n, 2));
  }
  return at::cat({codes, absmax.contiguous().view(at::kByte)});
}

namespace {

// The CPU decode as one pass, block by block over the threads: the same fp32 products as the ATen
// expression below (a division by 127 then a product for int8, a product for NF4), rounded to
// the output dtype as a cast does.
template <typename Out>
void decode_blocks(FrozenStorage s, const uint8_t* codes, const float* absmax, int64_t blocks, Out* out) {
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float am = absmax[b];
      Out* o = out + b * kBlock;
      if (s == FrozenStorage::kInt8) {
        const auto* q = reinterpret_cast<const int8_t*>(codes) + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) o[i] = static_cast<Out>((static_cast<float>(q[i]) / 127.0f) * am);
      } else {
        const uint8_t* q = codes + b * (kBlock / 2);
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          o[2 * i] = static_cast<Out>(kNF4[q[i] >> 4] * am);
          o[2 * i + 1] = static_cast<Out>(kNF4[q[i] & 15] * am);
        }
      }
    }
  });
}

bool decode_on_cpu(FrozenStorage s, const at::Tensor& stored, const at::Tensor& out, int64_t cb) {
  if (!stored.is_cpu() || !out.is_cpu() || !out.is_contiguous() || !stored.is_contiguous()) return false;
  const uint8_t* codes = stored.data_ptr<uint8_t>();
  const auto* absmax = reinterpret_cast<const float*>(codes + cb);
  const int64_t blocks = out.numel() / kBlock;
  switch (out.scalar_type()) {
    case at::kFloat: decode_blocks(s, codes, absmax, blocks, out.data_ptr<float>()); return true;
    case at::kBFloat16: decode_blocks(s, codes, absmax, blocks, out.data_ptr<at::BFloat16>()); return true;
    case at::kHalf: decode_blocks(s, codes, absmax, blocks, out.data_ptr<at::Half>()); return true;
    default: return false;
  }
}

}  // namespace

void decode(FrozenStorage s, const at::Tensor& stored, const at::Tensor& out) {
  if (!quantized(s)) {
    out.copy_(stored);
    return;
  }
  const int64_t n = out.numel();
  check_blocks(n);
  const int64_t cb = code_bytes(s, n);
  if (decode_on_cpu(s, stored, out, cb)) return;
  const at::Tensor absmax = stored.narrow(0, cb, n / kBlock * 4).view(at::kFloat).unsqueeze(1);
  const at::Tensor codes = stored.narrow(0, 0, cb);
  at::Tensor values;
  if (s == FrozenStorage::kInt8) {
    const at::Tensor unit =
        codes.view(at::kChar).to(at::kFloat).reshape({-1, kBlock}) / at::full({1}, 127.0f, absmax.options());
    values = unit * absmax;
  } else {
    const at::Tensor q = at::stack({at::bitwise_right_shift(codes, 4), at::bitwise_and(codes, 15)}, 1).reshape({-1});
    values = levels(stored.device()).index({q.to(at::kLong)}).reshape({-1, kBlock}) * absmax;
  }
  out.copy_(values.reshape({-1}));
}

}  // namespace fsdp::frozen
