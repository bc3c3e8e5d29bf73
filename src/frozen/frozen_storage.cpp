// FrozenStorage's names, and the storage onto the kernels: a floating storage is a plain cast, int8 and NF4 are the
// block codec of kernels/ops.h (encode_blocks, decode_blocks; the format is Note [Frozen storage] in
// kernels/cpu/blocks.cpp). This file only maps the option onto a kernels::BlockFormat and brings
// tensors into the kernels' contract (fp32/bf16/fp16, contiguous, exact sizes).
#include "frozen/frozen_storage.h"

#include <ATen/ATen.h>

#include "base/named.h"
#include "fsdp/errors.h"
#include "kernels/ops.h"

namespace fsdp {
namespace {

constexpr base::Named<FrozenStorage> kFrozenStorages[] = {
    {FrozenStorage::kParamDtype, "param_dtype"},
    {FrozenStorage::kFloat32, "float32"},
    {FrozenStorage::kBFloat16, "bfloat16"},
    {FrozenStorage::kFloat16, "float16"},
    {FrozenStorage::kInt8, "int8"},
    {FrozenStorage::kNF4, "nf4"},
};

}  // namespace

const char* frozen_storage_name(FrozenStorage s) { return base::name_of(kFrozenStorages, s, "unknown"); }

FrozenStorage parse_frozen_storage(const std::string& name) {
  if (auto s = base::value_of(kFrozenStorages, name)) return *s;
  throw ConfigError("fsdp: unknown frozen storage '" + name + "' (expected " + base::names_text(kFrozenStorages) + ")");
}

}  // namespace fsdp

namespace fsdp::frozen {
namespace {

static_assert(kBlock == kernels::kQuantBlock, "frozen storage blocks are the kernels' blocks");

kernels::BlockFormat format(FrozenStorage s) {
  return s == FrozenStorage::kNF4 ? kernels::BlockFormat::kNF4 : kernels::BlockFormat::kInt8;
}

void check_blocks(int64_t numel) {
  if (numel % kBlock != 0) {
    throw ConfigError("fsdp: a quantized frozen shard of " + std::to_string(numel) +
                      " elements is not a whole number of " + std::to_string(kBlock) + "-element blocks");
  }
}

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// The kernels run on the CPU and CUDA; a tensor elsewhere goes through the CPU.
bool kernel_device(const at::Device& d) { return d.is_cpu() || d.is_cuda(); }

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
  return quantized(s) ? kernels::block_stored_bytes(format(s), numel) : numel;
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

const float* nf4_levels() { return kernels::kNF4Levels; }

at::Tensor encode(FrozenStorage s, const at::Tensor& values) {
  if (!quantized(s)) return values.to(stored_dtype(s)).contiguous();
  const int64_t n = values.numel();
  check_blocks(n);
  const auto bytes = values.options().dtype(at::kByte);
  if (values.is_meta()) return at::empty({stored_numel(s, n)}, bytes);
  if (!kernel_device(values.device())) return encode(s, values.cpu()).to(values.device());
  at::Tensor stored = at::empty({stored_numel(s, n)}, bytes);
  encode_into(s, values, stored);
  return stored;
}

void encode_into(FrozenStorage s, const at::Tensor& values, const at::Tensor& stored) {
  if (!quantized(s)) {
    stored.copy_(values.reshape(stored.sizes()));
    return;
  }
  if (!kernel_device(values.device()) || values.device() != stored.device() || !stored.is_contiguous()) {
    stored.copy_(encode(s, values));
    return;
  }
  check_blocks(values.numel());
  // Any other floating dtype through fp32 (widening bf16/fp16 there would change nothing).
  const at::Tensor in = (kernel_dtype(values.scalar_type()) ? values : values.to(at::kFloat)).contiguous();
  kernels::encode_blocks(format(s), in, stored);
}

void encode_range(FrozenStorage s, const at::Tensor& values, const at::Tensor& stored, int64_t numel, int64_t begin) {
  if (values.scalar_type() == at::kByte) {  // whole blocks already in the NF4 stored form
    const int64_t blocks = values.numel() / (kBlock / 2 + 4), codes = blocks * kBlock / 2;
    if (s != FrozenStorage::kNF4) {
      at::Tensor decoded = at::empty({blocks * kBlock}, at::kFloat);
      decode(FrozenStorage::kNF4, values, decoded);
      return encode_range(s, decoded, stored, numel, begin);
    }
    check_blocks(begin);
    check_blocks(numel);
    stored.narrow(0, begin / 2, codes).copy_(values.narrow(0, 0, codes));
    stored.narrow(0, numel / 2 + begin / kBlock * 4, blocks * 4).copy_(values.narrow(0, codes, blocks * 4));
    return;
  }
  const int64_t n = values.numel();
  if (!quantized(s)) {
    stored.narrow(0, begin, n).copy_(values.reshape({-1}));
    return;
  }
  check_blocks(begin);
  check_blocks(numel);
  const int64_t padded = (n + kBlock - 1) / kBlock * kBlock;
  at::Tensor in = values.reshape({-1});
  if (padded != n) {
    in = at::zeros({padded}, values.options());
    in.narrow(0, 0, n).copy_(values.reshape({-1}));
  }
  const at::Tensor part = encode(s, in.is_cpu() ? in : in.cpu());  // [codes | absmax] of these blocks
  const int64_t absmax_bytes = padded / kBlock * 4, codes = part.numel() - absmax_bytes;
  const int64_t all_codes = stored_numel(s, numel) - numel / kBlock * 4;
  stored.narrow(0, begin / kBlock * (codes / (padded / kBlock)), codes).copy_(part.narrow(0, 0, codes));
  stored.narrow(0, all_codes + begin / kBlock * 4, absmax_bytes).copy_(part.narrow(0, codes, absmax_bytes));
}

void decode(FrozenStorage s, const at::Tensor& stored, const at::Tensor& out) {
  if (!quantized(s)) {
    out.copy_(stored);
    return;
  }
  const int64_t n = out.numel();
  check_blocks(n);
  if (out.is_meta()) return;
  const at::Tensor in = stored.reshape({-1}).narrow(0, 0, stored_numel(s, n)).contiguous();
  if (kernel_device(out.device()) && in.device() == out.device() && kernel_dtype(out.scalar_type()) &&
      out.is_contiguous()) {
    kernels::decode_blocks(format(s), in, out);  // one pass, straight into `out`
    return;
  }
  // Elsewhere (another dtype, a strided `out`, another device): decoded into fp32, then cast.
  const at::Tensor device_in = kernel_device(in.device()) ? in : in.cpu();
  at::Tensor values = at::empty({n}, device_in.options().dtype(at::kFloat));
  kernels::decode_blocks(format(s), device_in, values);
  out.copy_(values.view(out.sizes()));
}

}  // namespace fsdp::frozen
