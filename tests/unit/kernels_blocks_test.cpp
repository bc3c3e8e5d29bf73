// The block codec of kernels/ops.h (encode_blocks, decode_blocks; Note [Frozen storage] in
// kernels/cpu/blocks.cpp): the CPU twins against hand-computed blocks (zeros, the absmax, ties,
// midpoints, denormal and huge scales) and, bit for bit, against the ATen expression that
// frozen storage (now src/frozen/frozen_storage.cpp) used before the twins (KernelBlocks.*); FrozenStorage's mapping
// onto them; the CUDA kernels against the twins (KernelBlocksCuda.*, of the gpu tier, skipped without a GPU: compiled,
// untested on a GPU).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/errors.h"
#include "kernels/cpu/twins.h"
#include "kernels/ops.h"
#include "frozen/frozen_storage.h"

namespace fsdp::kernels {
namespace {

const BlockFormat kFormats[] = {BlockFormat::kInt8, BlockFormat::kNF4};
const char* name(BlockFormat f) { return f == BlockFormat::kNF4 ? "nf4" : "int8"; }

at::Tensor encoded(BlockFormat f, const at::Tensor& values) {
  at::Tensor stored = at::empty({block_stored_bytes(f, values.numel())}, values.options().dtype(at::kByte));
  encode_blocks(f, values, stored);
  return stored;
}

at::Tensor decoded(BlockFormat f, const at::Tensor& stored, int64_t n, at::ScalarType dtype = at::kFloat) {
  at::Tensor out = at::empty({n}, stored.options().dtype(dtype));
  decode_blocks(f, stored, out);
  return out;
}

// A tensor's bytes, whatever its dtype (a NaN compares equal to itself here).
std::vector<uint8_t> bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.numel() * c.element_size());
}

float absmax_of(BlockFormat f, const at::Tensor& stored, int64_t n, int64_t block) {
  float am;
  std::memcpy(&am, bytes_of(stored).data() + block_code_bytes(f, n) + 4 * block, 4);
  return am;
}

// ---- the ATen expression the twins replaced (in frozen storage before them) ------------------------

at::Tensor reference_encode(BlockFormat f, const at::Tensor& values) {
  const int64_t n = values.numel();
  const at::Tensor blocks = values.to(at::kFloat).reshape({-1, kQuantBlock});
  const at::Tensor absmax = blocks.abs().amax(1);
  const at::Tensor safe = absmax.clamp_min(1e-38);
  at::Tensor codes;
  if (f == BlockFormat::kInt8) {
    const at::Tensor unit = blocks / at::where(absmax > 0, absmax, at::ones_like(absmax)).unsqueeze(1);
    codes = (unit * at::full({1}, 127.0f, absmax.options())).round().to(at::kChar).view(at::kByte).reshape({-1});
  } else {
    const at::Tensor inv = at::full({1}, 1.0f, absmax.options()) / safe;
    const at::Tensor scaled = (blocks * inv.unsqueeze(1)).clamp(-1, 1).reshape({-1});
    const at::Tensor lv = at::from_blob(const_cast<float*>(kNF4Levels), {16}, at::kFloat).clone();
    const at::Tensor mid = (lv.narrow(0, 0, 15) + lv.narrow(0, 1, 15)) / 2;
    const at::Tensor q = at::bucketize(scaled, mid, /*out_int32=*/true, /*right=*/false).to(at::kByte);
    codes = at::bitwise_or(at::bitwise_left_shift(q.slice(0, 0, n, 2), 4), q.slice(0, 1, n, 2));
  }
  return at::cat({codes, absmax.contiguous().view(at::kByte)});
}

at::Tensor reference_decode(BlockFormat f, const at::Tensor& stored, int64_t n) {
  const int64_t cb = block_code_bytes(f, n);
  const at::Tensor absmax = stored.narrow(0, cb, n / kQuantBlock * 4).view(at::kFloat).unsqueeze(1);
  const at::Tensor codes = stored.narrow(0, 0, cb);
  if (f == BlockFormat::kInt8) {
    const at::Tensor unit =
        codes.view(at::kChar).to(at::kFloat).reshape({-1, kQuantBlock}) / at::full({1}, 127.0f, absmax.options());
    return (unit * absmax).reshape({-1});
  }
  const at::Tensor lv = at::from_blob(const_cast<float*>(kNF4Levels), {16}, at::kFloat).clone();
  const at::Tensor q = at::stack({at::bitwise_right_shift(codes, 4), at::bitwise_and(codes, 15)}, 1).reshape({-1});
  return (lv.index({q.to(at::kLong)}).reshape({-1, kQuantBlock}) * absmax).reshape({-1});
}

// Blocks at very different scales (one of zeros, one of tiny and denormal values, one near
// FLT_MAX / 2), values on the int8 ties, and random normal values.
at::Tensor mixed_values(int64_t blocks, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn({blocks, kQuantBlock}, at::kFloat);
  x = x * at::pow(10.0, at::randint(-6, 7, {blocks, 1}, at::kFloat));
  x[0].zero_();
  if (blocks > 3) {
    x[1].copy_(at::randn({kQuantBlock}) * 1e-39f);
    x[2].copy_(at::randn({kQuantBlock}).clamp(-4, 4) * (FLT_MAX / 8.0f));  // x / absmax, x * inv stay finite
    x[3].zero_();
    for (int k = 0; k < 16; ++k) x[3][k] = static_cast<float>((k - 8 + 0.5) / 127.0);
    x[3][16] = 1.0f;
  }
  return x.reshape({-1});
}

// `x` in `dtype`, within fp16's range (its cast would make infinities of the huge block).
at::Tensor as_input(const at::Tensor& x, at::ScalarType dtype) {
  return (dtype == at::kHalf ? x.clamp(-60000, 60000) : x).to(dtype);
}

TEST(KernelBlocks, Int8HandComputed) {
  // Block 0: zeros. Block 1: absmax 1 and exact ties of (x / 1) * 127. Block 2: absmax FLT_MAX,
  // whose half is a tie 63.5 -> 64. Block 3: a denormal absmax gives back +-absmax.
  at::Tensor x = at::zeros({4 * kQuantBlock}, at::kFloat);
  float* p = x.data_ptr<float>();
  p[64] = 1.0f;
  p[65] = -1.0f;
  const float half_steps[] = {0.5f, 1.5f, 2.5f, 3.5f, -0.5f, -1.5f, -2.5f};
  const int8_t tie_codes[] = {0, 2, 2, 4, 0, -2, -2};  // round half to even
  for (int k = 0; k < 7; ++k) {
    p[66 + k] = static_cast<float>(half_steps[k] / 127.0);
    ASSERT_EQ((p[66 + k] / 1.0f) * 127.0f, half_steps[k]) << "not an exact tie: " << k;
  }
  p[128] = FLT_MAX;
  p[129] = FLT_MAX / 2;
  p[130] = -FLT_MAX;
  const float tiny = std::ldexp(1.0f, -140);
  p[192] = tiny;
  p[193] = -tiny;
  const at::Tensor stored = encoded(BlockFormat::kInt8, x);
  const std::vector<uint8_t> b = bytes_of(stored);
  ASSERT_EQ(b.size(), static_cast<size_t>(4 * 64 + 4 * 4));
  for (int i = 0; i < 64; ++i) EXPECT_EQ(b[i], 0) << i;
  EXPECT_EQ(static_cast<int8_t>(b[64]), 127);
  EXPECT_EQ(static_cast<int8_t>(b[65]), -127);
  for (int k = 0; k < 7; ++k) EXPECT_EQ(static_cast<int8_t>(b[66 + k]), tie_codes[k]) << half_steps[k];
  EXPECT_EQ(static_cast<int8_t>(b[128]), 127);
  EXPECT_EQ(static_cast<int8_t>(b[129]), 64);
  EXPECT_EQ(static_cast<int8_t>(b[130]), -127);
  EXPECT_EQ(static_cast<int8_t>(b[192]), 127);
  EXPECT_EQ(static_cast<int8_t>(b[193]), -127);
  const float expected_absmax[] = {0.0f, 1.0f, FLT_MAX, tiny};
  for (int k = 0; k < 4; ++k) EXPECT_EQ(absmax_of(BlockFormat::kInt8, stored, 256, k), expected_absmax[k]) << k;
  const at::Tensor v = decoded(BlockFormat::kInt8, stored, 256);
  const float* d = v.data_ptr<float>();
  for (int i = 0; i < 64; ++i) EXPECT_EQ(d[i], 0.0f) << i;
  EXPECT_EQ(d[64], 1.0f);  // q = +-127 gives back +-absmax exactly
  EXPECT_EQ(d[65], -1.0f);
  EXPECT_EQ(d[68], (2.0f / 127.0f) * 1.0f);
  EXPECT_EQ(d[128], FLT_MAX);
  EXPECT_EQ(d[129], (64.0f / 127.0f) * FLT_MAX);
  EXPECT_EQ(d[192], tiny);
  EXPECT_EQ(d[193], -tiny);
}

TEST(KernelBlocks, NF4HandComputed) {
  // Block 0: zeros (code 7, 0.0, in both nibbles). Block 1: absmax 1, so s = x: +-1, 0, values on
  // the midpoints around 0 (a midpoint takes the lower level) and just beyond them, 0.5 (level 12).
  const float mid6 = (kNF4Levels[6] + kNF4Levels[7]) / 2.0f, mid7 = (kNF4Levels[7] + kNF4Levels[8]) / 2.0f;
  at::Tensor x = at::zeros({2 * kQuantBlock}, at::kFloat);
  float* p = x.data_ptr<float>();
  const float block1[] = {1.0f, -1.0f, 0.0f, mid7, std::nextafter(mid7, 1.0f), mid6, std::nextafter(mid6, 1.0f), 0.5f};
  const uint8_t codes[] = {15, 0, 7, 7, 8, 6, 7, 12};
  for (int i = 0; i < 8; ++i) p[64 + i] = block1[i];
  const at::Tensor stored = encoded(BlockFormat::kNF4, x);
  const std::vector<uint8_t> b = bytes_of(stored);
  ASSERT_EQ(b.size(), static_cast<size_t>(2 * 32 + 2 * 4));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(b[i], 0x77) << i;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b[32 + i], (codes[2 * i] << 4) | codes[2 * i + 1]) << i;  // high nibble first
  for (int i = 36; i < 64; ++i) EXPECT_EQ(b[i], 0x77) << i;
  EXPECT_EQ(absmax_of(BlockFormat::kNF4, stored, 128, 0), 0.0f);
  EXPECT_EQ(absmax_of(BlockFormat::kNF4, stored, 128, 1), 1.0f);
  const at::Tensor v = decoded(BlockFormat::kNF4, stored, 128);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(v[i].item<float>(), 0.0f) << i;
  for (int i = 0; i < 8; ++i) EXPECT_EQ(v[64 + i].item<float>(), kNF4Levels[codes[i]]) << i;
}

TEST(KernelBlocks, NaNPropagatesIntoItsBlock) {
  for (BlockFormat f : kFormats) {
    at::Tensor x = at::full({2 * kQuantBlock}, 0.25f);
    x[3] = NAN;
    const at::Tensor stored = encoded(f, x);
    EXPECT_TRUE(std::isnan(absmax_of(f, stored, 128, 0))) << name(f);
    const at::Tensor v = decoded(f, stored, 128);
    EXPECT_TRUE(v.narrow(0, 0, 64).isnan().all().item<bool>()) << name(f);
    EXPECT_TRUE(at::equal(v.narrow(0, 64, 64), decoded(f, encoded(f, x.narrow(0, 64, 64).clone()), 64))) << name(f);
  }
}

TEST(KernelBlocks, TwinMatchesFormerATenExpression) {
  for (int64_t blocks : {1, 4, 7, 20000}) {  // 20000 blocks: several threads' worth
    const at::Tensor x = mixed_values(blocks, 40 + blocks);
    const int64_t n = x.numel();
    for (BlockFormat f : kFormats) {
      for (auto in_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const std::string what =
            std::string(name(f)) + " blocks=" + std::to_string(blocks) + " " + c10::toString(in_dtype);
        const at::Tensor in = as_input(x, in_dtype);
        const at::Tensor stored = encoded(f, in);
        ASSERT_TRUE(at::equal(stored, reference_encode(f, in))) << what;
        const at::Tensor expected = reference_decode(f, stored, n);
        for (auto out_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
          EXPECT_TRUE(at::equal(decoded(f, stored, n, out_dtype), expected.to(out_dtype)))
              << what << " -> " << c10::toString(out_dtype);
        }
      }
    }
  }
}

// The dispatched build (on an AVX2 CPU the AVX2 build, Note [NF4 eight at a time]) against the
// baseline build's scalar loops, byte for byte: encoded blocks of every input dtype, including blocks
// holding a NaN or an infinity; and decoded codes of random bytes under every kind of absmax (zero,
// denormal, huge, infinite, NaN) into every output dtype, where bf16 and fp16 round ties and overflow.
TEST(KernelBlocks, DispatchedBuildMatchesBaseline) {
  const NF4Table& t = nf4_table();
  const int64_t blocks = 3000;
  at::Tensor x = mixed_values(blocks, 77);
  x[5 * kQuantBlock + 9] = NAN;
  x[6 * kQuantBlock + 63] = INFINITY;
  x[7 * kQuantBlock] = -INFINITY;
  x[8 * kQuantBlock + 1] = -NAN;
  const ElemType types[] = {ElemType::kFloat32, ElemType::kBFloat16, ElemType::kFloat16};
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (BlockFormat f : kFormats) {
    for (int k = 0; k < 3; ++k) {
      const std::string what =
          std::string(name(f)) + " from " + c10::toString(dtypes[k]) + ", dispatched " + cpu::capability();
      const at::Tensor in = as_input(x, dtypes[k]).contiguous();
      const int64_t cb = block_code_bytes(f, in.numel());
      at::Tensor base = at::empty({block_stored_bytes(f, in.numel())}, at::kByte);
      cpu::DEFAULT::encode_blocks(f, t, in.data_ptr(), types[k], blocks, base.data_ptr<uint8_t>(),
                                  base.data_ptr<uint8_t>() + cb);
      ASSERT_EQ(bytes_of(base), bytes_of(encoded(f, in))) << what;
    }
    // Random codes; the absmax of each block drawn from the kinds above.
    at::manual_seed(78);
    const int64_t n = blocks * kQuantBlock, cb = block_code_bytes(f, n);
    at::Tensor stored = at::randint(0, 256, {block_stored_bytes(f, n)}, at::kByte);
    at::Tensor am = (at::randn({blocks}) * at::pow(10.0, at::randint(-44, 39, {blocks}, at::kFloat))).abs();
    am[0] = 0.0f;
    am[1] = INFINITY;
    am[2] = NAN;
    am[3] = 3.0e38f;
    am[4] = 65504.0f;  // fp16's largest: the top levels overflow nothing, rounding may
    am[5] = 1e-40f;    // denormal
    stored.narrow(0, cb, blocks * 4).copy_(am.view(at::kByte));
    for (int k = 0; k < 3; ++k) {
      at::Tensor base = at::empty({n}, dtypes[k]);
      cpu::DEFAULT::decode_blocks(f, t, stored.data_ptr<uint8_t>(), stored.data_ptr<uint8_t>() + cb, blocks,
                                  base.data_ptr(), types[k]);
      ASSERT_EQ(bytes_of(base), bytes_of(decoded(f, stored, n, dtypes[k])))
          << name(f) << " into " << c10::toString(dtypes[k]) << ", dispatched " << cpu::capability();
    }
  }
}

TEST(KernelBlocks, ThreadCountInvariant) {
  const at::Tensor x = mixed_values(5000, 7);
  for (BlockFormat f : kFormats) {
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const at::Tensor one = encoded(f, x);
    const at::Tensor one_values = decoded(f, one, x.numel());
    at::set_num_threads(threads);
    EXPECT_TRUE(at::equal(one, encoded(f, x))) << name(f);
    EXPECT_TRUE(at::equal(one_values, decoded(f, one, x.numel()))) << name(f);
  }
}

// FrozenStorage maps onto the kernels: the same bytes, other dtypes and strided outputs through fp32.
TEST(KernelBlocks, FrozenStorageIsTheCodec) {
  const at::Tensor x = mixed_values(6, 3);
  for (auto s : {FrozenStorage::kInt8, FrozenStorage::kNF4}) {
    const BlockFormat f = s == FrozenStorage::kNF4 ? BlockFormat::kNF4 : BlockFormat::kInt8;
    const at::Tensor stored = frozen::encode(s, x.to(at::kDouble));
    EXPECT_EQ(stored.numel(), frozen::stored_numel(s, x.numel()));
    EXPECT_TRUE(at::equal(stored, encoded(f, x))) << name(f);
    at::Tensor strided = at::empty({2 * x.numel()}, at::kDouble).slice(0, 0, 2 * x.numel(), 2);
    frozen::decode(s, stored, strided);
    EXPECT_TRUE(at::equal(strided, decoded(f, stored, x.numel()).to(at::kDouble))) << name(f);
  }
  EXPECT_EQ(frozen::nf4_levels()[15], 1.0f);
  EXPECT_THROW(frozen::encode(FrozenStorage::kNF4, at::zeros({65})), ConfigError);
}

TEST(KernelBlocks, BadArgumentsAreNamed) {
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const at::Tensor x = at::randn({128});
  const at::Tensor stored = encoded(BlockFormat::kNF4, x);
  expect_error([&] { encoded(BlockFormat::kInt8, at::randn({100})); }, "not a whole number of 64-value blocks");
  expect_error([&] { encode_blocks(BlockFormat::kNF4, x, at::empty({100}, at::kByte)); }, "stored has 100 elements");
  expect_error([&] { encoded(BlockFormat::kNF4, x.to(at::kDouble)); }, "values must be Float or BFloat16 or Half");
  expect_error([&] { decode_blocks(BlockFormat::kInt8, stored, at::empty({128})); }, "stored has 72 elements");
  expect_error([&] { decode_blocks(BlockFormat::kNF4, stored, at::empty({128}, at::kDouble)); }, "out must be");
  expect_error([&] { decode_blocks(BlockFormat::kNF4, stored.to(at::kChar), at::empty({128})); },
               "stored must be Byte");
}

// ---- CUDA kernels against their twins (compiled, untested on a GPU) -----------------------------

bool skip_without_gpu() { return !cuda_kernels_built() || !at::hasCUDA(); }
#define FSDP_SKIP_WITHOUT_GPU()                                                                       \
  if (skip_without_gpu()) {                                                                           \
    GTEST_SKIP() << (cuda_kernels_built() ? "no GPU on this machine" : "built without CUDA kernels"); \
  }

TEST(KernelBlocksCuda, EncodeAndDecodeMatchTwin) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int64_t blocks : {1, 7, 20000}) {
    const at::Tensor x = mixed_values(blocks, 90 + blocks);
    const int64_t n = x.numel();
    for (BlockFormat f : kFormats) {
      for (auto in_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const std::string what =
            std::string(name(f)) + " blocks=" + std::to_string(blocks) + " " + c10::toString(in_dtype);
        const at::Tensor in = as_input(x, in_dtype);
        const at::Tensor stored = encoded(f, in);
        // The GPU's stored form at byte offset 0 (aligned absmax) and 1 (byte-wise absmax).
        for (int64_t offset : {0, 1}) {
          const int64_t bytes = block_stored_bytes(f, n);
          at::Tensor gstored =
              at::empty({bytes + 1}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA)).narrow(0, offset, bytes);
          encode_blocks(f, in.cuda(), gstored);
          EXPECT_TRUE(at::equal(gstored.cpu(), stored)) << what << " offset=" << offset;
          for (auto out_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
            EXPECT_TRUE(at::equal(decoded(f, gstored, n, out_dtype).cpu(), decoded(f, stored, n, out_dtype)))
                << what << " offset=" << offset << " -> " << c10::toString(out_dtype);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace fsdp::kernels
