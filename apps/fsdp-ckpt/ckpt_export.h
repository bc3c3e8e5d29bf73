// What fsdp-ckpt export's two forms share: a model checkpoint as a Hugging Face directory
// (ckpt_hf.cpp) and a LoRA run's checkpoint as a PEFT adapter or a merged model (ckpt_lora.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ckpt_commands.h"
#include "ckpt_view.h"

namespace fsdp_ckpt {

constexpr const char* kDefaultMaxShardSize = "50GB";

// export's arguments: DIR OUT and the options --dtype NAME, --tokenizer-dir DIR,
// --max-shard-size SIZE (or --opt=VALUE) and --merged anywhere.
struct ExportArgs {
  std::string dir, out, dtype, tokenizer_dir, max_shard_size = kDefaultMaxShardSize;
  bool merged = false;  // a LoRA checkpoint: the base with its adapters folded in, not the adapter
};
ExportArgs parse_export_args(const Args& args);

at::ScalarType scalar_type_of(const std::string& dtype);  // "bfloat16", "float16", "float32"
uint64_t parse_shard_size(const std::string& text);       // Note [Export shards]
// Refuses an output directory that exists and is not empty (nothing is overwritten); makes it.
void check_out_dir(const std::string& out);

using Shapes = std::map<std::string, std::vector<int64_t>>;
// Rows [first, first + count) of a tensor (along its first dimension) as fp32 values, or an
// undefined tensor to read them from the checkpoint's F32 model files. Export asks for at most
// fsdp::kExportChunkBytes of fp32 values at a time (one row when a row is larger).
using RowsFn = std::function<at::Tensor(const std::string& name, int64_t first, int64_t count)>;
// Writes `names` as Note [Export shards] splits them into `out`, chunk by chunk of rows; returns the
// file names, and the data bytes in `total`.
std::vector<std::string> write_model_files(const Checkpoint& ckpt, const std::vector<std::string>& names,
                                           const std::string& out, at::ScalarType dtype, uint64_t max_bytes,
                                           uint64_t& total, const Shapes& shapes, const RowsFn& rows = nullptr);
// The number of elements in one row (first dimension) of `shape`; 1 for a scalar.
int64_t row_numel(const std::vector<int64_t>& shape);
// `count` values of `dtype` at `offset` of dir/file, read straight into a tensor of their own.
at::Tensor read_values(const std::string& dir, const std::string& file, uint64_t offset, int64_t count,
                       at::ScalarType dtype);

// Note [Tokenizer files]: where they come from ("" for nowhere), and the copy.
std::string tokenizer_source(const ExportArgs& e, const Checkpoint& ckpt, const llama::LlamaConfig& config);
std::vector<std::string> copy_tokenizer_files(const std::string& src, const std::string& out);

// A LoRA run's checkpoint (extra.config.lora.enabled): the PEFT adapter, or with --merged the
// merged model (ckpt_lora.cpp). Null when the checkpoint is not a LoRA run's.
const nlohmann::json* lora_section(const Checkpoint& ckpt);
int export_lora(const Checkpoint& ckpt, const ExportArgs& e, const nlohmann::json& lora);
// The LoRA run's model unsharded, as it computes: the base (from the checkpoint, or the directory
// the run imported), fsdp::lora with the run's section, the adapters from the checkpoint.
void load_lora_unsharded(const Checkpoint& ckpt, const nlohmann::json& lora, llama::LlamaForCausalLM& model);

}  // namespace fsdp_ckpt
