// What the planner's unit tests share (plan_test.cpp, plan_phases_test.cpp): a small Qwen2-like
// config and a request on 2 ranks in bf16.
#pragma once

#include <cstdint>

#include "fsdp/plan.h"
#include "llama.h"

namespace fsdp {

inline llama::LlamaConfig qwen_like(bool tied) {
  llama::LlamaConfig c;
  c.model_type = "qwen2";
  c.vocab_size = 1000, c.hidden_size = 64, c.intermediate_size = 96, c.num_hidden_layers = 3;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  return c;
}

inline PlanRequest request(int64_t host_bytes) {
  PlanRequest r;
  r.ranks_per_node = 2;
  r.param_dtype = at::kBFloat16;
  r.seq_len = 128;
  r.batch_per_rank = 4;
  r.process_host_bytes = 100 << 20;
  r.budget.host_bytes = host_bytes;
  r.budget.disk_bytes = int64_t{1} << 40;
  return r;
}

}  // namespace fsdp
