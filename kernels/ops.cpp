// Argument checks and device dispatch for the operations of kernels/ops.h: a CUDA tensor goes to
// the CUDA kernels (kernels/cuda/, or a clear error in a CPU-only build), anything else to the CPU
// twins (kernels/cpu/). The per-step scalars are computed here once, for both.
#include "kernels/ops.h"

#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "fsdp/errors.h"
#include "kernels/cpu/twins.h"
#include "kernels/device_ops.h"

namespace fsdp::kernels {
namespace {

std::string describe(const at::Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "] on " + t.device().str();
}

void check(bool ok, const char* op, const std::string& what) {
  if (!ok) throw Error(std::string("fsdp::kernels::") + op + ": " + what);
}

ElemType elem_type(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? ElemType::kBFloat16
         : t.scalar_type() == at::kHalf   ? ElemType::kFloat16
                                          : ElemType::kFloat32;
}

// Defined, contiguous, of an allowed dtype, on `device`.
void check_tensor(const char* op, const char* name, const at::Tensor& t, const c10::Device& device,
                  std::initializer_list<at::ScalarType> dtypes) {
  check(t.defined(), op, std::string(name) + " is undefined");
  bool dtype_ok = false;
  for (auto d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  std::string allowed;
  for (auto d : dtypes) allowed += std::string(allowed.empty() ? "" : " or ") + c10::toString(d);
  check(dtype_ok, op, std::string(name) + " must be " + allowed + ", got " + describe(t));
  check(t.is_contiguous(), op,
        std::string(name) + " must be contiguous, got " + describe(t) + " with strides " + c10::str(t.strides()));
  check(t.device() == device, op,
        std::string(name) + " is " + describe(t) + " but the first argument is on " + device.str() +
            "; all tensors must be on one device");
}

void check_numel(const char* op, const char* name, const at::Tensor& t, int64_t numel) {
  check(t.numel() == numel, op,
        std::string(name) + " has " + std::to_string(t.numel()) + " elements, expected " + std::to_string(numel));
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void check_disjoint(const char* op, const char* a_name, const at::Tensor& a, const char* b_name, const at::Tensor& b) {
  check(!overlap(a, b), op, std::string(a_name) + " and " + b_name + " overlap in memory; they must be distinct");
}

}  // namespace

// Note [Twin numerics]
// The reference is the ATen sequence the runtime used before the kernels existed (kernels/ops.h).
// ATen rounds each Scalar argument to the fp32 "opmath" type once, so the scalars below are
// computed in double and rounded once, here, for the twin and the kernel alike. ATen's lerp is a
// fused multiply-add (at::vec::fmadd) in its vectorized CPU kernel; the twins and kernels use an
// explicit fma there and no other contraction (twins: -ffp-contract=off; CUDA: --fmad=false), so
// on AVX2 machines the twin matches ATen element for element and the CUDA kernel matches the twin
// (IEEE sqrt and division on both). Tests still compare with named tolerances, because the
// DEFAULT build of the twins (no FMA) rounds the lerp twice.
void fused_adamw(const AdamWArgs& args, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& param_copy) {
  const char* op = "fused_adamw";
  check(param.defined(), op, "param is undefined");
  const auto device = param.device();
  check_tensor(op, "param", param, device, {at::kFloat});
  check_tensor(op, "grad", grad, device, {at::kFloat});
  check_tensor(op, "exp_avg", exp_avg, device, {at::kFloat});
  check_tensor(op, "exp_avg_sq", exp_avg_sq, device, {at::kFloat});
  const int64_t n = param.numel();
  check_numel(op, "grad", grad, n);
  check_numel(op, "exp_avg", exp_avg, n);
  check_numel(op, "exp_avg_sq", exp_avg_sq, n);
  if (param_copy.defined()) {
    check_tensor(op, "param_copy", param_copy, device, {at::kBFloat16, at::kHalf, at::kFloat});
    check_numel(op, "param_copy", param_copy, n);
  }
  const at::Tensor* all[] = {&param, &grad, &exp_avg, &exp_avg_sq, &param_copy};
  const char* names[] = {"param", "grad", "exp_avg", "exp_avg_sq", "param_copy"};
  for (int i = 0; i < 5; ++i) {
    for (int j = i + 1; j < 5; ++j) {
      if (all[i]->defined() && all[j]->defined()) check_disjoint(op, names[i], *all[i], names[j], *all[j]);
    }
  }
  check(args.step >= 1, op, "step must be >= 1 (the step being taken), got " + std::to_string(args.step));
  if (n == 0) return;

  AdamWScalars s;
  s.apply_decay = args.weight_decay != 0;
  s.decay = static_cast<float>(1 - args.lr * args.weight_decay);
  const float w = static_cast<float>(1 - args.beta1);
  s.lerp_small = std::abs(w) < 0.5f;
  s.lerp_coeff = s.lerp_small ? w : w - 1.0f;
  s.beta2 = static_cast<float>(args.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - args.beta2);
  const double bc1 = 1 - std::pow(args.beta1, static_cast<double>(args.step));
  const double bc2 = 1 - std::pow(args.beta2, static_cast<double>(args.step));
  s.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(args.eps);
  s.step_size = static_cast<float>(-args.lr / bc1);

  if (param.is_cuda()) return cuda::adamw(s, param, grad, exp_avg, exp_avg_sq, param_copy);
  check(param.is_cpu(), op, "unsupported device " + device.str());
  cpu::adamw(s, param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
             exp_avg_sq.data_ptr<float>(), param_copy.defined() ? param_copy.data_ptr() : nullptr,
             param_copy.defined() ? elem_type(param_copy) : ElemType::kFloat32, n);
}

void copy_in(const at::Tensor& src, const at::Tensor& dst, double divide_by) {
  const char* op = "copy_in";
  check(src.defined(), op, "src is undefined");
  check_tensor(op, "src", src, src.device(), {at::kFloat, at::kBFloat16, at::kHalf});
  check_tensor(op, "dst", dst, src.device(), {at::kFloat, at::kBFloat16, at::kHalf});
  check(dst.numel() >= src.numel(), op, "dst (" + describe(dst) + ") is smaller than src (" + describe(src) + ")");
  check_disjoint(op, "src", src, "dst", dst);
  check(std::isfinite(divide_by) && divide_by != 0, op,
        "divide_by must be finite and non-zero, got " + std::to_string(divide_by));
  if (dst.numel() == 0) return;
  const float d = static_cast<float>(divide_by);
  if (src.is_cuda()) return cuda::copy_in(src, dst, d);
  check(src.is_cpu(), op, "unsupported device " + src.device().str());
  cpu::copy_in(src.data_ptr(), elem_type(src), dst.data_ptr(), elem_type(dst), src.numel(), dst.numel(), d);
}

void copy_out(const at::Tensor& src, const at::Tensor& dst, const CopyOutOptions& options) {
  const char* op = "copy_out";
  check(src.defined(), op, "src is undefined");
  check_tensor(op, "src", src, src.device(), {at::kFloat, at::kBFloat16, at::kHalf});
  check_tensor(op, "dst", dst, src.device(), {at::kFloat});
  check_numel(op, "dst", dst, src.numel());
  const bool same = src.numel() > 0 && src.data_ptr() == dst.data_ptr() && src.scalar_type() == at::kFloat;
  if (!(same && !options.accumulate)) check_disjoint(op, "src", src, "dst", dst);
  check(std::isfinite(options.divide_by) && options.divide_by != 0, op,
        "divide_by must be finite and non-zero, got " + std::to_string(options.divide_by));
  if (src.numel() == 0) return;
  const float d = static_cast<float>(options.divide_by);
  if (src.is_cuda()) return cuda::copy_out(src, dst, d, options.accumulate);
  check(src.is_cpu(), op, "unsupported device " + src.device().str());
  cpu::copy_out(src.data_ptr(), elem_type(src), dst.data_ptr<float>(), src.numel(), d, options.accumulate);
}

void sum_of_squares(const at::Tensor& x, const at::Tensor& out) {
  const char* op = "sum_of_squares";
  check(x.defined(), op, "x is undefined");
  check_tensor(op, "x", x, x.device(), {at::kFloat});
  check_tensor(op, "out", out, x.device(), {at::kDouble});
  check_numel(op, "out", out, 1);
  if (x.numel() == 0) return;
  if (x.is_cuda()) return cuda::sum_of_squares(x, out);
  check(x.is_cpu(), op, "unsupported device " + x.device().str());
  *out.data_ptr<double>() += cpu::sum_of_squares(x.data_ptr<float>(), x.numel());
}

void scale_(const at::Tensor& x, double factor) {
  const char* op = "scale_";
  check(x.defined(), op, "x is undefined");
  check_tensor(op, "x", x, x.device(), {at::kFloat});
  if (x.numel() == 0) return;
  if (x.is_cuda()) return cuda::scale(x, static_cast<float>(factor));
  check(x.is_cpu(), op, "unsupported device " + x.device().str());
  cpu::scale(x.data_ptr<float>(), x.numel(), static_cast<float>(factor));
}

const NF4Table& nf4_table() {
  static const NF4Table table = [] {
    NF4Table t{};
    for (int j = 0; j < 16; ++j) t.levels[j] = kNF4Levels[j];
    for (int j = 0; j < 15; ++j) t.mids[j] = (kNF4Levels[j] + kNF4Levels[j + 1]) / 2.0f;
    return t;
  }();
  return table;
}

namespace {

void check_blocks(const char* op, const char* name, const at::Tensor& t) {
  check(t.numel() % kQuantBlock == 0, op,
        std::string(name) + " (" + describe(t) + ") is not a whole number of " + std::to_string(kQuantBlock) +
            "-value blocks");
}

}  // namespace

void encode_blocks(BlockFormat f, const at::Tensor& values, const at::Tensor& stored) {
  const char* op = "encode_blocks";
  check(values.defined(), op, "values is undefined");
  check_tensor(op, "values", values, values.device(), {at::kFloat, at::kBFloat16, at::kHalf});
  check_tensor(op, "stored", stored, values.device(), {at::kByte});
  check_blocks(op, "values", values);
  check_numel(op, "stored", stored, block_stored_bytes(f, values.numel()));
  check_disjoint(op, "values", values, "stored", stored);
  if (values.numel() == 0) return;
  if (values.is_cuda()) return cuda::encode_blocks(f, nf4_table(), values, stored);
  check(values.is_cpu(), op, "unsupported device " + values.device().str());
  auto* bytes = stored.data_ptr<uint8_t>();
  cpu::encode_blocks(f, nf4_table(), values.data_ptr(), elem_type(values), values.numel() / kQuantBlock, bytes,
                     bytes + block_code_bytes(f, values.numel()));
}

void decode_blocks(BlockFormat f, const at::Tensor& stored, const at::Tensor& out) {
  const char* op = "decode_blocks";
  check(stored.defined(), op, "stored is undefined");
  check_tensor(op, "stored", stored, stored.device(), {at::kByte});
  check_tensor(op, "out", out, stored.device(), {at::kFloat, at::kBFloat16, at::kHalf});
  check_blocks(op, "out", out);
  check_numel(op, "stored", stored, block_stored_bytes(f, out.numel()));
  check_disjoint(op, "stored", stored, "out", out);
  if (out.numel() == 0) return;
  if (stored.is_cuda()) return cuda::decode_blocks(f, nf4_table(), stored, out);
  check(stored.is_cpu(), op, "unsupported device " + stored.device().str());
  const auto* bytes = stored.data_ptr<uint8_t>();
  cpu::decode_blocks(f, nf4_table(), bytes, bytes + block_code_bytes(f, out.numel()), out.numel() / kQuantBlock,
                     out.data_ptr(), elem_type(out));
}

bool cuda_kernels_built() { return cuda::built(); }

}  // namespace fsdp::kernels
