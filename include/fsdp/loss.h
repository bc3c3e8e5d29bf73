// A language model's loss without its logits: the output projection and the cross-entropy computed a
// chunk of tokens at a time, so the [tokens, vocab] logits (and their gradient) never exist whole.
// At a 152k-token vocabulary the logits of 2048 tokens are 1.2 GiB in fp32; chunked by 1024 tokens
// the loss holds 0.6 GiB at most, at 256 tokens 0.15 GiB, whatever the sequence.
//
//   at::Tensor h = fsdp::call(model->body, tokens);                     // [B, T, d], before the head
//   at::Tensor loss = fsdp::chunked_cross_entropy(h, head->weight, targets, /*chunk_tokens=*/1024);
//
// The result is the mean over the targets that are not `ignore_index` (at::cross_entropy_loss's
// default reduction) of -log softmax(h @ weight^T)[target], with its gradients for `hidden` and for
// `weight` (when it requires grad; a frozen head gets none). Each chunk's logits are computed as
// at::linear computes them in hidden's dtype, then taken to fp32, as `at::cross_entropy_loss(
// at::linear(h, weight).to(at::kFloat), targets)` does; forward and backward equal that unchunked
// loss within fp32 rounding (the gradient of a bf16 weight within bf16 rounding: it is summed over
// the chunks in fp32 and rounded once). The backward recomputes each chunk's logits: one more
// matrix product of the head's size than the unchunked loss. Works on any module whose forward ends
// in a linear head, sharded or not: call it inside the forward of the unit that owns `weight`.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fsdp {

// hidden [..., d], weight [vocab, d], targets int64 of hidden's leading shape ([...]); chunk_tokens
// > 0 (rows of the flattened hidden per chunk). Throws UsageError on shapes or dtypes that do not
// fit together, naming them.
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 int64_t chunk_tokens, int64_t ignore_index = -100);

}  // namespace fsdp
