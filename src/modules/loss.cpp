// See fsdp/loss.h.
//
// Note [Chunked cross-entropy]
// Forward, per chunk of C rows: z = linear(h_c, W) in h's dtype, taken to fp32; lse = logsumexp(z);
// the chunk adds sum(lse - z[target]) over its valid rows. Only lse (fp32, one per row) is saved
// beside h, W and the targets. Backward, per chunk: z again, p = exp(z - lse), p[target] -= 1, rows
// of ignored targets zeroed, scaled by grad / valid rows; that is dz, the gradient of the fp32
// logits. Then dh_c = dz @ W as linear's backward would, with dz cast to h's dtype, written into
// dh's rows; and dW += dz^T @ h_c in fp32, in place (a product into a temporary would hold a second
// [vocab, d] tensor), cast to W's dtype at the end (in fp32 the sum is the gradient itself). At most
// one chunk's [C, vocab] logits and their gradient exist at a time.
#include "fsdp/loss.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>

#include "fsdp/errors.h"

namespace fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
 public:
  // h [N, d], weight [V, d], targets [N]; returns the mean loss over the valid rows.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, int64_t ignore_index) {
    const int64_t n = h.size(0);
    at::Tensor lse = at::empty({n}, h.options().dtype(at::kFloat));
    at::Tensor total = at::zeros({}, h.options().dtype(at::kFloat));
    const at::Tensor valid = targets.ne(ignore_index);
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      const at::Tensor z = at::linear(h.narrow(0, start, len), weight).to(at::kFloat);
      const at::Tensor l = at::logsumexp(z, {1});
      lse.narrow(0, start, len).copy_(l);
      const at::Tensor t = targets.narrow(0, start, len);
      const at::Tensor ok = valid.narrow(0, start, len);
      const at::Tensor picked = z.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1);
      total.add_(((l - picked) * ok).sum());
    }
    const at::Tensor count = valid.sum().to(at::kFloat);
    ctx->save_for_backward({h, weight, targets, lse, count});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["ignore_index"] = ignore_index;
    return total / count;  // no valid row: nan, as at::cross_entropy_loss gives
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3], &count = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt(), ignore_index = ctx->saved_data["ignore_index"].toInt();
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const at::Tensor scale = grad_outputs[0].to(at::kFloat) / count;
    const int64_t n = h.size(0);
    at::Tensor dh = want_h ? at::empty_like(h) : at::Tensor();
    at::Tensor dw = want_w ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat)) : at::Tensor();
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      const at::Tensor hc = h.narrow(0, start, len);
      const at::Tensor t = targets.narrow(0, start, len);
      at::Tensor dz = at::linear(hc, weight).to(at::kFloat).sub_(lse.narrow(0, start, len).unsqueeze(1)).exp_();
      dz.scatter_add_(1, t.clamp_min(0).unsqueeze(1), at::full({len, 1}, -1.0, dz.options()));
      dz.mul_((t.ne(ignore_index).to(at::kFloat) * scale).unsqueeze(1));
      // In place, with no [vocab, d] temporary: the fp32 sum takes the fp32 dz (and h_c in fp32).
      if (want_h) {
        at::Tensor rows = dh.narrow(0, start, len);
        at::mm_out(rows, dz.to(h.scalar_type()), weight);
      }
      if (want_w) dw.addmm_(dz.t(), hc.to(at::kFloat));
    }
    return {dh, want_w ? dw.to(weight.scalar_type()) : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 int64_t chunk_tokens, int64_t ignore_index) {
  auto shape = [](const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("undefined"); };
  if (!hidden.defined() || !weight.defined() || !targets.defined() || hidden.dim() < 1 || weight.dim() != 2 ||
      hidden.size(-1) != weight.size(1) || targets.sizes() != hidden.sizes().slice(0, hidden.dim() - 1)) {
    throw UsageError(
        "fsdp::chunked_cross_entropy: expects hidden [..., d], weight [vocab, d] and targets of "
        "hidden's leading shape [...]; got hidden " +
        shape(hidden) + ", weight " + shape(weight) + ", targets " + shape(targets));
  }
  if (targets.scalar_type() != at::kLong || !at::isFloatingType(hidden.scalar_type()) ||
      hidden.scalar_type() != weight.scalar_type()) {
    throw UsageError(
        "fsdp::chunked_cross_entropy: targets must be int64 and hidden and weight of one floating "
        "dtype; got targets " +
        std::string(c10::toString(targets.scalar_type())) + ", hidden " + c10::toString(hidden.scalar_type()) +
        ", weight " + c10::toString(weight.scalar_type()));
  }
  if (chunk_tokens <= 0) {
    throw UsageError("fsdp::chunked_cross_entropy: chunk_tokens must be positive, got " + std::to_string(chunk_tokens));
  }
  const int64_t d = hidden.size(-1);
  return ChunkedCrossEntropy::apply(hidden.reshape({-1, d}), weight, targets.reshape({-1}), chunk_tokens, ignore_index);
}

}  // namespace fsdp
