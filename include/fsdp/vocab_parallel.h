// A frozen vocabulary table that is never gathered: the embedding lookup and the output head's
// cross-entropy computed where the table's rows are, across the ranks of its shard group.
//
// A language model's embedding and head are [vocab, dim] tables: at a 152k-token vocabulary and
// dim 896 one table is 260 MiB in bf16, at 128k x 4096 a GiB. Sharded as a unit, such a table is
// gathered whole for its forward (and the head again for its backward), though a step's tokens
// read only a few of its rows and multiply the others by a few hundred hidden states. With the
// table frozen (a LoRA base), each rank can instead compute on the rows its shard holds:
//
//   auto opts = fsdp::FullyShardOptions().vocab_parallel(true);
//   fsdp::fully_shard(model->embed_tokens, mesh, opts);        // before the root, like a layer
//   ...
//   at::Tensor x = fsdp::sharded_embedding(*model->embed_tokens, tokens);          // [B, T, dim]
//   ...
//   at::Tensor loss = fsdp::sharded_cross_entropy(*model->embed_tokens, h, targets);  // tied head
//
// sharded_embedding gathers every rank's token ids, each rank fills the rows it holds (parts of a
// row split between two shards included) and a reduce-scatter sums each rank's rows back to it:
// about 4 x dim bytes per token and rank on the wire, instead of the table. sharded_cross_entropy
// gathers every rank's hidden states and targets, each rank computes the logits of its rows for
// all of them, a chunk of rows at a time with a running log-sum-exp (so no [tokens, vocab]
// logits exist), and the ranks combine their sums; backward recomputes the chunks and
// reduce-scatters the hidden states' gradients. The logits a rank computes are those of its rows
// for every rank's tokens: the same arithmetic as the whole head's, spread over the ranks.
//
// Each is a collective over the table's shard group: every rank of it calls it, in the same order,
// with token counts that may differ (shorter inputs are padded); not inside an fsdp::Join, whose
// finished ranks would take no part (UsageError). The table's gradient is never
// computed (it is frozen). Results equal an unsharded lookup and at::cross_entropy_loss(
// at::linear(h, table).to(at::kFloat), targets) within fp32 rounding (the log-sum-exp is summed a
// chunk at a time; a row split between shards has its dot product summed from two parts in fp32).
// On a module that is not sharded both are the plain computations on its one parameter, so the
// same model runs unsharded.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace fsdp {

// tokens: int64 of any shape, each in [0, vocab). Returns tokens' shape + [dim] in the table's
// compute dtype (the unit's param_dtype), without gradient. Throws UsageError naming a token out
// of range (on every rank: the ids are checked after they are gathered).
at::Tensor sharded_embedding(const torch::nn::Module& table, const at::Tensor& tokens);

// hidden [..., dim] (cast to the table's compute dtype), targets int64 of hidden's leading shape,
// each in [0, vocab) or ignore_index. The mean over this rank's targets that are not ignore_index
// of -log softmax(hidden @ table^T)[target] (nan when none is), with the gradient for hidden.
// chunk_rows: rows of the table per chunk of logits (0: as many as keep a chunk's fp32 logits,
// and its rows in fp32, within 16 MiB).
at::Tensor sharded_cross_entropy(const torch::nn::Module& table, const at::Tensor& hidden, const at::Tensor& targets,
                                 int64_t ignore_index = -100, int64_t chunk_rows = 0);

// The rows per chunk sharded_cross_entropy takes when chunk_rows is 0, for `tokens` hidden states
// (every rank's) of `dim` values: a chunk's fp32 logits and its rows in fp32 within 16 MiB each,
// 64 rows at least. For a plan of its memory.
int64_t sharded_cross_entropy_chunk_rows(int64_t tokens, int64_t dim);

}  // namespace fsdp
