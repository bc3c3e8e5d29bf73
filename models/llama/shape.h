// The model's shape for the planner (fsdp/plan.h): its units as fsdp-train shards them (one per
// decoder layer, the root holding the embedding, the final norm and the head) with the bytes each
// keeps for backward (Note [Activation bytes] in shape.cpp).
#pragma once

#include <cstdint>

#include <c10/core/ScalarType.h>

#include "fsdp/lora.h"
#include "fsdp/plan.h"
#include "llama.h"

namespace llama {

// `lora`: the model with fsdp::lora's adapters (trainable) on a frozen base stored as its
// base_dtype says; null: every parameter trained.
// `loss_chunk_tokens` > 0: the head and the loss run that many tokens at a time
// (LlamaForCausalLM::set_loss_chunk_tokens), and the root keeps no logits.
// `split_root`: the embedding and the head are units of their own (shard_embedding_and_head): the
// root (the final norm) first, then the embedding, the layers and the head, in forward order.
// `vocab_parallel`: the embedding and the head are vocab-parallel tables (shard_vocab_parallel;
// needs `lora`, whose base they belong to): never gathered, the loss chunked over the head's rows.
fsdp::ModelShape plan_shape(const LlamaConfig& config, const fsdp::LoraOptions* lora = nullptr,
                            int64_t loss_chunk_tokens = 0, bool split_root = false, bool vocab_parallel = false);
// The loss over vocab-parallel tables (fsdp::sharded_cross_entropy) beyond what the forward kept:
// a chunk's fp32 logits and their exponentials (about 16 MiB each) and every rank's hidden states
// with their fp32 gradient; `world` ranks' tokens.
int64_t vocab_parallel_loss_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype,
                                  int64_t world);

// Bytes kept for backward by one layer's forward over `batch` x `seq_len` tokens in `dtype`, and
// by the rest of the model (embedding output, final norm, the logits and the loss's log-probabilities).
int64_t layer_activation_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype);
// With loss_chunk_tokens > 0 the root keeps one fp32 log-sum-exp per token instead of the logits.
int64_t root_activation_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype,
                              int64_t loss_chunk_tokens = 0);
// The loss's backward beyond what the forward kept: the gradients of the log-probabilities and of
// the fp32 logits, and the logits' gradient in the compute dtype; chunked, the same for one chunk,
// plus the head's fp32 gradient sum when the head trains in a narrower dtype.
int64_t loss_backward_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype,
                            int64_t loss_chunk_tokens = 0, bool head_trained = true);

}  // namespace llama
