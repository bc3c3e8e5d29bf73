// The kernels of kernels/ops.h: each CPU twin against a plain ATen reference (Kernel.*), each CUDA
// kernel against its CPU twin (KernelCuda.*, skipped without a GPU), on fresh random inputs of
// sizes 1, odd, not a multiple of the vector width, and large (several threads' worth), at
// unaligned offsets, with named tolerances per dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/errors.h"
#include "kernels/cpu/twins.h"
#include "kernels/ops.h"

namespace fsdp::kernels {
namespace {

// Named tolerances, llm.c / ggml style: fp32 results may differ from ATen only by rounding order
// (one fused lerp, scalar tails); bf16/fp16 outputs by one unit in their last place.
struct Tolerance {
  double rtol;
  double atol;
};
constexpr Tolerance kFp32Tol{1e-6, 1e-7};
constexpr Tolerance kBf16Tol{1e-2, 1e-2};
constexpr Tolerance kFp16Tol{1e-3, 1e-3};
constexpr double kSumOfSquaresRtol = 1e-12;  // double accumulation, different summation order

Tolerance tolerance_for(at::ScalarType t) {
  return t == at::kBFloat16 ? kBf16Tol : t == at::kHalf ? kFp16Tol : kFp32Tol;
}

// 1, odd, below/above the AVX2 width of 8, not a multiple of 4 or 8, and larger than several
// grain sizes (so at::parallel_for splits it when threads are allowed).
const std::vector<int64_t> kSizes = {1, 7, 31, 1000, 1000003};

// A fresh random tensor of n elements at `offset` elements into its storage (an unaligned view
// for offset % 4 != 0), never zeros.
at::Tensor random_view(int64_t n, int64_t offset, at::ScalarType dtype, uint64_t seed, double scale = 1.0,
                       bool positive = false) {
  at::manual_seed(seed);
  auto base = at::randn({n + offset}, at::kFloat) * scale;
  if (positive) base = base.abs() + 1e-3 * scale;
  return base.to(dtype).narrow(0, offset, n);
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, Tolerance tol, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  auto a = actual.to(at::kDouble).cpu(), e = expected.to(at::kDouble).cpu();
  auto err = (a - e).abs();
  auto bound = e.abs() * tol.rtol + tol.atol;
  const int64_t bad = (err > bound).sum().item<int64_t>();
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.numel() << " elements beyond rtol " << tol.rtol << " atol "
                    << tol.atol << ", max error " << err.max().item<double>();
}

struct AdamWCase {
  double beta1;
  double weight_decay;
  int64_t step;
};
// beta1 = 0.3 takes ATen's other lerp branch (weight 0.7 >= 0.5).
const std::vector<AdamWCase> kAdamWCases = {{0.9, 0.0, 1}, {0.9, 0.1, 10}, {0.3, 0.05, 3}};

AdamWArgs args_for(const AdamWCase& c) {
  AdamWArgs a;
  a.lr = 1e-2;
  a.beta1 = c.beta1;
  a.beta2 = 0.999;
  a.eps = 1e-8;
  a.weight_decay = c.weight_decay;
  a.step = c.step;
  return a;
}

// The ATen sequence the runtime used before the fused kernel (src/optim/optim.cpp).
void reference_adamw(const AdamWArgs& a, at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v) {
  if (a.weight_decay != 0) p.mul_(1 - a.lr * a.weight_decay);
  m.lerp_(g, 1 - a.beta1);
  v.mul_(a.beta2).addcmul_(g, g, 1 - a.beta2);
  const double bc1 = 1 - std::pow(a.beta1, static_cast<double>(a.step));
  const double bc2 = 1 - std::pow(a.beta2, static_cast<double>(a.step));
  auto denom = (v.sqrt() / std::sqrt(bc2)).add_(a.eps);
  p.addcdiv_(m, denom, -a.lr / bc1);
}

struct AdamWInputs {
  at::Tensor p, g, m, v;
};
// Each array at its own offset, so no two share an alignment.
AdamWInputs adamw_inputs(int64_t n, uint64_t seed) {
  return {random_view(n, 1, at::kFloat, seed), random_view(n, 2, at::kFloat, seed + 1, 0.1),
          random_view(n, 3, at::kFloat, seed + 2, 0.01), random_view(n, 0, at::kFloat, seed + 3, 1e-3, true)};
}

TEST(Kernel, AdamWTwinMatchesATen) {
  for (int64_t n : kSizes) {
    for (const auto& c : kAdamWCases) {
      for (at::ScalarType copy_dtype : {at::kBFloat16, at::kHalf}) {
        const std::string what = "n=" + std::to_string(n) + " beta1=" + std::to_string(c.beta1) +
                                 " wd=" + std::to_string(c.weight_decay) + " step=" + std::to_string(c.step) +
                                 " copy=" + c10::toString(copy_dtype);
        auto in = adamw_inputs(n, 100 + n);
        auto ref_p = in.p.clone(), ref_m = in.m.clone(), ref_v = in.v.clone();
        const auto a = args_for(c);
        reference_adamw(a, ref_p, in.g, ref_m, ref_v);
        auto copy = at::full({n}, 7.0, at::TensorOptions().dtype(copy_dtype));
        fused_adamw(a, in.p, in.g, in.m, in.v, copy);
        expect_close(in.p, ref_p, kFp32Tol, what + " param");
        expect_close(in.m, ref_m, kFp32Tol, what + " exp_avg");
        expect_close(in.v, ref_v, kFp32Tol, what + " exp_avg_sq");
        expect_close(copy, ref_p.to(copy_dtype), tolerance_for(copy_dtype), what + " param_copy");
        // The copy is the cast of the kernel's own param, exactly.
        EXPECT_TRUE(at::equal(copy, in.p.to(copy_dtype))) << what;
      }
    }
  }
}

TEST(Kernel, AdamWTwinIsThreadCountInvariant) {
  const int64_t n = 1000003;
  const auto a = args_for(kAdamWCases[1]);
  auto one = adamw_inputs(n, 7);
  auto two = AdamWInputs{one.p.clone(), one.g.clone(), one.m.clone(), one.v.clone()};
  fused_adamw(a, one.p, one.g, one.m, one.v);
  at::set_num_threads(2);
  fused_adamw(a, two.p, two.g, two.m, two.v);
  at::set_num_threads(1);
  EXPECT_TRUE(at::equal(one.p, two.p));
  EXPECT_TRUE(at::equal(one.m, two.m));
  EXPECT_TRUE(at::equal(one.v, two.v));
}

TEST(Kernel, CopyInTwinMatchesATen) {
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (int64_t n : kSizes) {
    for (auto src_dtype : dtypes) {
      for (auto dst_dtype : dtypes) {
        for (double divide_by : {1.0, 3.0}) {
          const std::string what = "n=" + std::to_string(n) + " " + c10::toString(src_dtype) + "->" +
                                   c10::toString(dst_dtype) + " divide_by=" + std::to_string(divide_by);
          auto src = random_view(n, 1, src_dtype, 200 + n);
          const int64_t pad = 5;
          auto dst = at::full({n + pad}, 9.0, at::TensorOptions().dtype(dst_dtype));  // padding must be zeroed
          copy_in(src, dst, divide_by);
          auto expected = src.to(at::kFloat).div(divide_by).to(dst_dtype);
          // A cast rounds to nearest even, as Tensor::to: exact.
          EXPECT_TRUE(at::equal(dst.narrow(0, 0, n), expected)) << what;
          EXPECT_TRUE(at::equal(dst.narrow(0, n, pad), at::zeros({pad}, dst.options()))) << what << " padding";
        }
      }
    }
  }
}

TEST(Kernel, CopyOutTwinMatchesATen) {
  for (int64_t n : kSizes) {
    for (auto src_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (bool accumulate : {false, true}) {
        for (double divide_by : {1.0, 3.0}) {
          const std::string what = "n=" + std::to_string(n) + " " + c10::toString(src_dtype) +
                                   " accumulate=" + std::to_string(accumulate) +
                                   " divide_by=" + std::to_string(divide_by);
          auto src = random_view(n, 3, src_dtype, 300 + n);
          auto dst = random_view(n, 1, at::kFloat, 400 + n);
          auto scaled = src.to(at::kFloat).div(divide_by);
          auto expected = accumulate ? dst.add(scaled) : scaled;
          copy_out(src, dst, {divide_by, accumulate});
          expect_close(dst, expected, kFp32Tol, what);
          EXPECT_TRUE(at::equal(dst, expected)) << what << ": the contract's ops are ATen's, so exact";
        }
      }
    }
    // In place: src is dst.
    auto x = random_view(n, 1, at::kFloat, 500 + n);
    auto expected = x.div(4.0);
    copy_out(x, x, {4.0, false});
    EXPECT_TRUE(at::equal(x, expected)) << "in place, n=" << n;
  }
}

TEST(Kernel, SumOfSquaresTwinMatchesATen) {
  for (int64_t n : kSizes) {
    auto x = random_view(n, 1, at::kFloat, 600 + n);
    auto out = at::full({1}, 1.5, at::kDouble);  // accumulates into what is there
    sum_of_squares(x, out);
    const double expected = 1.5 + x.to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(out.item<double>(), expected, kSumOfSquaresRtol * expected) << "n=" << n;
  }
  // Fixed blocks in a fixed order: the same double with 1 or 2 threads.
  auto x = random_view(1000003, 0, at::kFloat, 601);
  auto one = at::zeros({1}, at::kDouble), two = at::zeros({1}, at::kDouble);
  sum_of_squares(x, one);
  at::set_num_threads(2);
  sum_of_squares(x, two);
  at::set_num_threads(1);
  EXPECT_EQ(one.item<double>(), two.item<double>());
}

TEST(Kernel, ScaleTwinMatchesATen) {
  for (int64_t n : kSizes) {
    auto x = random_view(n, 1, at::kFloat, 700 + n);
    auto expected = x.mul(0.37);
    scale_(x, 0.37);
    EXPECT_TRUE(at::equal(x, expected)) << "n=" << n;
  }
}

TEST(Kernel, BadArgumentsAreNamed) {
  auto p = at::randn({8}), g = at::randn({8}), m = at::randn({8}), v = at::rand({8});
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { fused_adamw({}, p, g.to(at::kDouble), m, v); }, "grad must be Float");
  expect_error([&] { fused_adamw({}, p, at::randn({9}), m, v); }, "grad has 9 elements");
  auto strided = at::randn({16}).slice(0, 0, 16, 2);
  expect_error([&] { fused_adamw({}, p, strided, m, v); }, "grad must be contiguous");
  expect_error([&] { fused_adamw({}, p, g, p, v); }, "param and exp_avg overlap");
  AdamWArgs zero_step;
  zero_step.step = 0;
  expect_error([&] { fused_adamw(zero_step, p, g, m, v); }, "step must be >= 1");
  expect_error([&] { copy_in(p, at::empty({4}, at::kBFloat16)); }, "smaller than src");
  expect_error([&] { copy_in(p.narrow(0, 0, 4), p.narrow(0, 2, 4)); }, "src and dst overlap");
  expect_error([&] { copy_out(g, at::empty({8}, at::kBFloat16)); }, "dst must be Float");
  expect_error([&] { copy_out(g, g, {1.0, true}); }, "overlap");
  expect_error([&] { sum_of_squares(p, at::zeros({1}, at::kFloat)); }, "out must be Double");
  expect_error([&] { scale_(p.to(at::kHalf), 2.0); }, "x must be Float");
}

// Both builds of the twins (Note [Two builds of the twins]): the public ops above run the one this
// CPU dispatches to; the baseline build is checked against it here, so it is tested on any machine.
TEST(Kernel, BaselineTwinMatchesDispatchedTwin) {
  for (int64_t n : kSizes) {
    const std::string what = "n=" + std::to_string(n) + " dispatched=" + cpu::capability();
    auto in = adamw_inputs(n, 1300 + n);
    auto base = AdamWInputs{in.p.clone(), in.g.clone(), in.m.clone(), in.v.clone()};
    auto copy = at::empty({n}, at::kHalf), base_copy = at::empty({n}, at::kHalf);
    const auto a = args_for(kAdamWCases[1]);
    fused_adamw(a, in.p, in.g, in.m, in.v, copy);
    AdamWScalars s;  // the scalars ops.cpp derives for kAdamWCases[1]
    s.apply_decay = true;
    s.decay = static_cast<float>(1 - a.lr * a.weight_decay);
    s.lerp_coeff = static_cast<float>(1 - a.beta1);
    s.beta2 = static_cast<float>(a.beta2);
    s.one_minus_beta2 = static_cast<float>(1 - a.beta2);
    s.sqrt_bc2 = static_cast<float>(std::sqrt(1 - std::pow(a.beta2, 10.0)));
    s.eps = static_cast<float>(a.eps);
    s.step_size = static_cast<float>(-a.lr / (1 - std::pow(a.beta1, 10.0)));
    cpu::DEFAULT::adamw(s, base.p.data_ptr<float>(), base.g.data_ptr<float>(), base.m.data_ptr<float>(),
                        base.v.data_ptr<float>(), base_copy.data_ptr(), ElemType::kFloat16, n);
    expect_close(base.p, in.p, kFp32Tol, what + " param");
    expect_close(base.m, in.m, kFp32Tol, what + " exp_avg");
    expect_close(base.v, in.v, kFp32Tol, what + " exp_avg_sq");
    expect_close(base_copy, copy, kFp16Tol, what + " param_copy");

    auto src = random_view(n, 1, at::kBFloat16, 1400 + n);
    auto dst = at::empty({n + 3}, at::kHalf), base_dst = at::full({n + 3}, 5.0, at::kHalf);
    copy_in(src, dst, 3.0);
    cpu::DEFAULT::copy_in(src.data_ptr(), ElemType::kBFloat16, base_dst.data_ptr(), ElemType::kFloat16, n, n + 3, 3.0f);
    EXPECT_TRUE(at::equal(base_dst, dst)) << what << " copy_in";

    auto acc = random_view(n, 2, at::kFloat, 1500 + n), base_acc = acc.clone();
    copy_out(src, acc, {2.0, true});
    cpu::DEFAULT::copy_out(src.data_ptr(), ElemType::kBFloat16, base_acc.data_ptr<float>(), n, 2.0f, true);
    EXPECT_TRUE(at::equal(base_acc, acc)) << what << " copy_out";

    auto out = at::zeros({1}, at::kDouble);
    sum_of_squares(acc, out);
    EXPECT_EQ(cpu::DEFAULT::sum_of_squares(acc.data_ptr<float>(), n), out.item<double>()) << what;
    auto scaled = acc.clone();
    scale_(scaled, 0.5);
    cpu::DEFAULT::scale(acc.data_ptr<float>(), n, 0.5f);
    EXPECT_TRUE(at::equal(acc, scaled)) << what << " scale";
  }
}

// ---- CUDA kernels against their twins --------------------------------------------------------

bool skip_without_gpu() { return !cuda_kernels_built() || !at::hasCUDA(); }
#define FSDP_SKIP_WITHOUT_GPU()                                                                       \
  if (skip_without_gpu()) {                                                                           \
    GTEST_SKIP() << (cuda_kernels_built() ? "no GPU on this machine" : "built without CUDA kernels"); \
  }

TEST(KernelCuda, AdamWMatchesTwin) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int64_t n : kSizes) {
    for (const auto& c : kAdamWCases) {
      for (bool aligned : {true, false}) {
        const std::string what =
            "n=" + std::to_string(n) + " beta1=" + std::to_string(c.beta1) + " aligned=" + std::to_string(aligned);
        auto in = adamw_inputs(n, 800 + n);
        if (aligned) in = AdamWInputs{in.p.clone(), in.g.clone(), in.m.clone(), in.v.clone()};
        // On the GPU at offset 1 (vector body with a head) or at the inputs' mixed offsets (scalar).
        auto to_gpu = [&](const at::Tensor& t) {
          auto buf = at::empty({t.numel() + 3}, t.options().device(at::kCUDA));  // room for offsets up to 3
          auto view = aligned ? buf.narrow(0, 1, t.numel()) : buf.narrow(0, t.storage_offset() % 4, t.numel());
          view.copy_(t);
          return view;
        };
        auto gp = to_gpu(in.p), gg = to_gpu(in.g), gm = to_gpu(in.m), gv = to_gpu(in.v);
        // The copy shares the others' offset in the aligned case, so the 4-wide body runs with a head.
        auto gcopy = at::empty({n + 1}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA))
                         .narrow(0, aligned ? 1 : 0, n);
        auto copy = at::empty({n}, at::kBFloat16);
        const auto a = args_for(c);
        fused_adamw(a, in.p, in.g, in.m, in.v, copy);
        fused_adamw(a, gp, gg, gm, gv, gcopy);
        expect_close(gp, in.p, kFp32Tol, what + " param");
        expect_close(gm, in.m, kFp32Tol, what + " exp_avg");
        expect_close(gv, in.v, kFp32Tol, what + " exp_avg_sq");
        expect_close(gcopy, copy, kBf16Tol, what + " param_copy");
      }
    }
  }
}

TEST(KernelCuda, CopyInMatchesTwin) {
  FSDP_SKIP_WITHOUT_GPU();
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (int64_t n : kSizes) {
    for (auto src_dtype : dtypes) {
      for (auto dst_dtype : dtypes) {
        for (double divide_by : {1.0, 3.0}) {
          auto src = random_view(n, 1, src_dtype, 900 + n);
          auto dst = at::full({n + 5}, 9.0, at::TensorOptions().dtype(dst_dtype));
          copy_in(src, dst, divide_by);
          // dst at offset 0 (4-wide body, src copied to offset 0 too) or 1 (offsets differ: scalar).
          for (int64_t dst_offset : {0, 1}) {
            auto gsrc = src.cuda();
            auto gdst =
                at::full({n + 5 + dst_offset}, 9.0, dst.options().device(at::kCUDA)).narrow(0, dst_offset, n + 5);
            copy_in(gsrc, gdst, divide_by);
            expect_close(gdst, dst, tolerance_for(dst_dtype),
                         "n=" + std::to_string(n) + " " + c10::toString(src_dtype) + "->" + c10::toString(dst_dtype) +
                             " dst_offset=" + std::to_string(dst_offset));
          }
        }
      }
    }
  }
}

TEST(KernelCuda, CopyOutMatchesTwin) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int64_t n : kSizes) {
    for (auto src_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (bool accumulate : {false, true}) {
        auto src = random_view(n, 3, src_dtype, 1000 + n);
        auto dst = random_view(n, 1, at::kFloat, 1100 + n);
        auto gsrc = src.cuda();
        auto gdst_aligned = dst.cuda();
        auto gdst_offset = at::empty({n + 1}, gdst_aligned.options()).narrow(0, 1, n);  // scalar path
        gdst_offset.copy_(gdst_aligned);
        copy_out(src, dst, {2.0, accumulate});
        for (const auto& gdst : {gdst_aligned, gdst_offset}) {
          copy_out(gsrc, gdst, {2.0, accumulate});
          expect_close(gdst, dst, kFp32Tol,
                       "n=" + std::to_string(n) + " " + c10::toString(src_dtype) + " dst offset " +
                           std::to_string(gdst.storage_offset()));
        }
      }
    }
  }
}

TEST(KernelCuda, SumOfSquaresAndScaleMatchTwin) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int64_t n : kSizes) {
    auto x = random_view(n, 1, at::kFloat, 1200 + n);
    auto gx = x.cuda();
    auto out = at::full({1}, 0.5, at::kDouble), gout = out.cuda();
    sum_of_squares(x, out);
    sum_of_squares(gx, gout);
    EXPECT_NEAR(gout.item<double>(), out.item<double>(), kSumOfSquaresRtol * out.item<double>()) << "n=" << n;
    scale_(x, 0.37);
    scale_(gx, 0.37);
    expect_close(gx, x, kFp32Tol, "scale n=" + std::to_string(n));
  }
}

}  // namespace
}  // namespace fsdp::kernels
