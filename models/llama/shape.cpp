// The model's shape for the planner, and the bytes its forward keeps for backward.
#include "shape.h"

#include <algorithm>
#include <string>

#include "fsdp/errors.h"
#include "fsdp/vocab_parallel.h"

namespace llama {
namespace {

// One RMSNorm's saved tensors over N tokens: the normalised input and the scaled output in the
// compute dtype, plus the fp32 copy of its input when computing in a narrower dtype.
int64_t norm_bytes(int64_t N, int64_t H, int64_t e) { return 2 * e * N * H + (e != 4 ? 4 * N * H : 0); }

}  // namespace

// Note [Activation bytes]
// What autograd keeps from forward to backward, counted from the model's operations
// (models/llama): per layer, the two norms (norm_bytes), the residual sum after attention and the
// layer's output (N*H each); for attention, q, k and v after the rotary embedding and the key/value
// head repeat, and the attention output that o_proj saves (4 * N * heads * head_dim), plus Qwen3's
// q/k norms over each head; then what the attention kernel itself keeps: with
// at::scaled_dot_product_attention (attn_implementation "sdpa") the fused kernel's log-sum-exp,
// B * heads * T in fp32, and with the eager path the softmax probabilities, B * heads * T^2 in fp32
// plus their copy in the compute dtype; a sliding window adds its boolean mask (T^2). For the MLP:
// gate, silu(gate), up and their product (4 * N * I). Tensors used only by a multiplication with a
// constant (the rotary tables) or by an addition are not kept. The root keeps the embedding output,
// the final norm and the loss's log-probabilities (fp32, N * vocab).
int64_t layer_activation_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t N = batch * seq_len, H = m.hidden_size, I = m.intermediate_size;
  const int64_t heads = m.num_attention_heads, q = heads * m.head_dim();
  const int64_t kv = m.num_key_value_heads * m.head_dim();
  const bool sdpa = m.attn_implementation == "sdpa";
  const int64_t attn_kernel = sdpa ? 4 * batch * heads * seq_len  // log-sum-exp
                                   : batch * heads * seq_len * seq_len * (4 + (e != 4 ? e : 0)) +
                                         seq_len * seq_len;  // probabilities, the causal mask
  const int64_t window_mask = sdpa && m.sliding_window > 0 ? seq_len * seq_len : 0;
  const int64_t qk_norms = m.qk_norm() ? norm_bytes(N, q, e) + norm_bytes(N, kv, e) : 0;
  return 2 * norm_bytes(N, H, e) + 2 * e * N * H + 4 * e * N * q + qk_norms + attn_kernel + window_mask + 4 * e * N * I;
}

int64_t root_activation_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype,
                              int64_t loss_chunk_tokens) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t N = batch * seq_len;
  const int64_t loss = loss_chunk_tokens > 0 ? 4 * N : 4 * N * m.vocab_size;  // log-sum-exp, or log-probabilities
  return e * N * m.hidden_size + norm_bytes(N, m.hidden_size, e) + loss;
}

int64_t loss_backward_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype,
                            int64_t loss_chunk_tokens, bool head_trained) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t N = batch * seq_len;
  if (loss_chunk_tokens <= 0) {
    // The gradient of the log-probabilities and the log-softmax's gradient, both fp32, at once, and
    // the logits' gradient cast to the compute dtype for the head's backward.
    return (8 + (e == 4 ? 0 : e)) * N * m.vocab_size;
  }
  // Note [Chunked cross-entropy] (src/modules/loss.cpp). Backward: one chunk's fp32 logits turned
  // into their gradient in place and its cast to the compute dtype; the head's gradient summed in
  // fp32 (in a narrower dtype a tensor of its own beside the one it is cast into). The forward's
  // end holds more: a chunk's logits (in the compute dtype, then fp32) and logsumexp's fp32
  // temporary beside them, with every activation kept, so its transient stands for the extra when
  // it is the larger (measured: the chunked forward is the step's peak with a frozen head).
  const int64_t rows = std::min(loss_chunk_tokens, N);
  const int64_t narrow = e == 4 ? 0 : e;
  const int64_t head_sum = head_trained && e != 4 ? 4 * m.vocab_size * m.hidden_size : 0;
  const int64_t backward = (4 + narrow) * rows * m.vocab_size + head_sum;
  const int64_t forward_end = (8 + narrow) * rows * m.vocab_size;
  return std::max(backward, forward_end);
}

int64_t vocab_parallel_loss_bytes(const LlamaConfig& m, int64_t batch, int64_t seq_len, at::ScalarType dtype,
                                  int64_t world) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t tokens = world * batch * seq_len;
  // Note [Vocab-parallel tables] (src/shard/vocab_parallel.cpp): chunks of rows whose fp32 logits
  // and whose rows in fp32 are 16 MiB at most, the logits in the compute dtype beside them, their
  // exponentials, and the rows cast to the compute dtype (when stored in another).
  const int64_t chunk_rows = std::min(m.vocab_size, fsdp::sharded_cross_entropy_chunk_rows(tokens, m.hidden_size));
  const int64_t chunk = (8 + e) * tokens * chunk_rows + e * chunk_rows * m.hidden_size;
  // The gathered hidden states and the gradient's two fp32 accumulators in forward; in backward
  // the gradient kept from forward, scaled, and this rank's share.
  return chunk + (e + 4 + 4) * tokens * m.hidden_size;
}

namespace {

// The trained and frozen counts of the model with `lora`'s adapters, unit by unit (root first):
// the model built on the meta device (no memory), adapted, and counted.
void count_lora(const LlamaConfig& config, const fsdp::LoraOptions& lora, bool split_root, fsdp::ModelShape& shape) {
  LlamaForCausalLM meta(config, at::kMeta);
  const fsdp::LoraModel adapted = fsdp::lora(*meta, lora);
  const bool tied = config.tie_word_embeddings;
  const fsdp::ModelShape counted = fsdp::model_shape(
      *meta,
      [split_root, tied](const std::string& name, torch::nn::Module&) {
        if (split_root && (name == "model.embed_tokens" || (name == "lm_head" && !tied))) return true;
        return name.rfind("model.layers.", 0) == 0 && name.find('.', 13) == std::string::npos;
      },
      adapted.frozen_storage());
  for (size_t i = 0; i < shape.units.size() && i < counted.units.size(); ++i) {
    shape.units[i].trainable_numel = counted.units[i].trainable_numel;
    shape.units[i].frozen_numel = counted.units[i].frozen_numel;
    shape.units[i].frozen_by_storage = counted.units[i].frozen_by_storage;
  }
  shape.name +=
      " + LoRA r=" + std::to_string(lora.r()) + " (base " + fsdp::frozen_storage_name(lora.base_dtype()) + ")";
}

// The shape with vocab-parallel tables: the split shape's units, the tables never gathered and
// moved in front of the layers (the last layer is the last unit to run forward, as at run time),
// and the loss computed on them.
fsdp::ModelShape vocab_parallel_shape(const LlamaConfig& config, const fsdp::LoraOptions* lora,
                                      int64_t loss_chunk_tokens) {
  if (lora == nullptr) {
    throw fsdp::ConfigError("llama::plan_shape: vocab-parallel tables are frozen; they need LoRA's frozen base");
  }
  const bool tied = config.tie_word_embeddings;
  LlamaConfig untied = config;
  untied.tie_word_embeddings = false;
  fsdp::ModelShape shape = plan_shape(untied, lora, loss_chunk_tokens, /*split_root=*/true);
  if (tied) {
    shape.units.pop_back();  // one table, the embedding's
    shape.name += ", tied";
  } else {
    std::rotate(shape.units.begin() + 2, shape.units.end() - 1, shape.units.end());  // the head after the embedding
  }
  shape.name += ", vocab-parallel tables";
  for (auto& u : shape.units) {
    if (u.name == "model.embed_tokens" || u.name == "lm_head") {
      u.vocab_parallel = true;
      u.name += " (vocab-parallel)";
    }
  }
  fsdp::UnitShape& root = shape.units.front();
  root.activations = [config](int64_t b, int64_t t, at::ScalarType d, bool) {
    return root_activation_bytes(config, b, t, d, /*loss_chunk_tokens=*/1);  // one log-sum-exp per token
  };
  root.backward_peak = [config](int64_t b, int64_t t, at::ScalarType d) {
    return vocab_parallel_loss_bytes(config, b, t, d, /*world=*/1);
  };
  return shape;
}

}  // namespace

fsdp::ModelShape plan_shape(const LlamaConfig& config, const fsdp::LoraOptions* lora, int64_t loss_chunk_tokens,
                            bool split_root, bool vocab_parallel) {
  if (split_root && !can_shard_embedding_and_head(config)) {
    throw fsdp::ConfigError(
        "llama::plan_shape: split_root with tie_word_embeddings: the embedding and the head are "
        "one tensor and stay in the root");
  }
  if (vocab_parallel) return vocab_parallel_shape(config, lora, loss_chunk_tokens);
  const ParamCounts counts = param_counts(config);
  const int64_t table = config.vocab_size * config.hidden_size;
  fsdp::ModelShape shape;
  shape.name = config.model_type;
  fsdp::UnitShape root;
  root.name = split_root ? "root (final norm)" : "root (embedding, final norm, lm_head)";
  root.is_root = true;
  root.checkpointable = false;
  root.trainable_numel = split_root ? config.hidden_size : counts.root;
  root.largest_param_numel = split_root ? config.hidden_size : table;
  // What the root keeps and its backward's extra (the loss's) are the model's, whichever unit
  // holds the head: the plan adds every unit's activations and takes the largest extra.
  root.activations = [config, loss_chunk_tokens](int64_t b, int64_t t, at::ScalarType d, bool) {
    return root_activation_bytes(config, b, t, d, loss_chunk_tokens);
  };
  const bool head_trained = lora == nullptr;
  root.backward_peak = [config, loss_chunk_tokens, head_trained](int64_t b, int64_t t, at::ScalarType d) {
    return loss_backward_bytes(config, b, t, d, loss_chunk_tokens, head_trained);
  };
  shape.units.push_back(root);
  fsdp::UnitShape table_unit;
  table_unit.checkpointable = false;
  table_unit.trainable_numel = table;
  table_unit.largest_param_numel = table;
  if (split_root) {
    table_unit.name = "model.embed_tokens";
    shape.units.push_back(table_unit);
  }
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    fsdp::UnitShape layer;
    layer.name = "model.layers." + std::to_string(i);
    layer.trainable_numel = counts.per_layer;
    layer.largest_param_numel = std::max(config.hidden_size, config.intermediate_size) * config.hidden_size;
    layer.activations = [config](int64_t b, int64_t t, at::ScalarType d, bool checkpointed) {
      // A checkpointed layer keeps only its input (the previous layer's output).
      return checkpointed ? static_cast<int64_t>(c10::elementSize(d)) * b * t * config.hidden_size
                          : layer_activation_bytes(config, b, t, d);
    };
    // Its backward's extra: the gradients of its largest activations (the MLP's), about its input's size.
    layer.backward_peak = [config](int64_t b, int64_t t, at::ScalarType d) {
      return 3 * static_cast<int64_t>(c10::elementSize(d)) * b * t * config.intermediate_size;
    };
    shape.units.push_back(std::move(layer));
  }
  if (split_root) {
    table_unit.name = "lm_head";
    shape.units.push_back(table_unit);
  }
  if (lora != nullptr) count_lora(config, *lora, split_root, shape);
  return shape;
}

}  // namespace llama
