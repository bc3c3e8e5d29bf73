// fsdp::chunked_cross_entropy (fsdp/loss.h) against the unchunked loss it replaces,
// at::cross_entropy_loss(at::linear(h, W).to(kFloat), targets): the loss and the gradients of the
// hidden states and of the head's weight, in fp32 and bf16, with chunks that divide the tokens,
// that do not, and that exceed them; ignored targets; a frozen head; and the refusals.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp/errors.h"
#include "fsdp/loss.h"

namespace fsdp {
namespace {

struct Result {
  at::Tensor loss, dh, dw;
};

Result run(bool chunked, at::ScalarType dtype, int64_t chunk, bool with_ignored, bool frozen_head) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const int64_t b = 3, t = 7, d = 16, v = 50;
  at::Tensor h = at::randn({b, t, d}, gen).to(dtype).requires_grad_();
  at::Tensor w = (at::randn({v, d}, gen) * 0.3).to(dtype).requires_grad_(!frozen_head);
  at::Tensor targets = at::randint(v, {b, t}, gen);
  if (with_ignored) {
    targets.index_put_({0, 0}, -100);
    targets.index_put_({2, 5}, -100);
  }
  // A product after the loss's input, so that dh comes through a real graph.
  at::Tensor hidden = h * 1.5;
  at::Tensor loss =
      chunked ? chunked_cross_entropy(hidden, w, targets, chunk)
              : at::cross_entropy_loss(at::linear(hidden, w).to(at::kFloat).reshape({-1, v}), targets.reshape({-1}));
  (loss * 2.0).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double tol, const char* what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) return;
  const double err = (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
  const double scale = b.to(at::kFloat).abs().max().item<double>();
  EXPECT_LE(err, tol * std::max(scale, 1e-30)) << what << ": max error " << err << " against max " << scale;
}

TEST(ChunkedLoss, EqualsTheUnchunkedLossAndGradientsInFp32) {
  for (int64_t chunk : {1, 4, 7, 21, 100}) {
    for (bool ignored : {false, true}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + (ignored ? ", some targets ignored" : ""));
      const Result ref = run(false, at::kFloat, 0, ignored, false);
      const Result got = run(true, at::kFloat, chunk, ignored, false);
      expect_close(got.loss, ref.loss, 1e-6, "loss");
      expect_close(got.dh, ref.dh, 1e-5, "hidden's gradient");
      expect_close(got.dw, ref.dw, 1e-5, "weight's gradient");
    }
  }
}

TEST(ChunkedLoss, EqualsTheUnchunkedLossInBf16WithinItsRounding) {
  const Result ref = run(false, at::kBFloat16, 0, true, false);
  const Result got = run(true, at::kBFloat16, 5, true, false);
  EXPECT_EQ(got.dh.scalar_type(), at::kBFloat16);
  EXPECT_EQ(got.dw.scalar_type(), at::kBFloat16);
  expect_close(got.loss, ref.loss, 1e-5, "loss");  // the logits are the same bf16 products, summed in fp32
  expect_close(got.dh, ref.dh, 1e-2, "hidden's gradient");
  expect_close(got.dw, ref.dw, 1e-2, "weight's gradient");
}

TEST(ChunkedLoss, AFrozenHeadGetsNoGradientAndTheHiddenStatesStillDo) {
  const Result ref = run(false, at::kFloat, 0, false, true);
  const Result got = run(true, at::kFloat, 4, false, true);
  EXPECT_FALSE(got.dw.defined());
  expect_close(got.dh, ref.dh, 1e-5, "hidden's gradient");
}

TEST(ChunkedLoss, RefusesShapesDtypesAndChunksThatDoNotFit) {
  const at::Tensor h = at::randn({2, 3, 8}), w = at::randn({10, 8}), t = at::randint(10, {2, 3});
  auto refused = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "not refused: " << needle;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&] { chunked_cross_entropy(h, at::randn({10, 9}), t, 4); }, "weight [10, 9]");
  refused([&] { chunked_cross_entropy(h, w, at::randint(10, {3, 2}), 4); }, "targets [3, 2]");
  refused([&] { chunked_cross_entropy(h, w, t.to(at::kInt), 4); }, "targets must be int64");
  refused([&] { chunked_cross_entropy(h, w.to(at::kDouble), t, 4); }, "weight Double");
  refused([&] { chunked_cross_entropy(h, w, t, 0); }, "chunk_tokens must be positive, got 0");
}

}  // namespace
}  // namespace fsdp
