// fsdp-ckpt export and logits: a checkpoint of fsdp-train's Llama as a Hugging Face
// LlamaForCausalLM directory, and the logits of the same weights run unsharded in LibTorch (the
// reference the export is checked against, tests/hf_interop_test.py).
//
// Note [Hugging Face config]
// config.json is the trainer's model section (LlamaConfig::to_json, keys already named as in
// transformers) plus what transformers would otherwise fill with defaults that our model does not
// implement, spelled out so a future default change cannot alter the model: hidden_act "silu", no
// attention or MLP biases, no dropout, head_dim = hidden_size / num_attention_heads,
// pretraining_tp 1. The rope base is written both as transformers 4's "rope_theta" and as
// transformers 5's "rope_parameters" {"rope_type": "default", "rope_theta": x}; each version reads
// its own. bos/eos/pad token ids are null: the trainer has no special tokens, and transformers'
// defaults (1 and 2) would claim otherwise.
#include <ATen/ATen.h>

#include <cinttypes>
#include <cstdio>
#include <stdexcept>

#include "base/file_io.h"
#include "safetensors/index.h"
#include "ckpt_commands.h"
#include "ckpt_view.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "npy.h"

namespace fsdp_ckpt {

using fsdp::CheckpointError;
using fsdp::io::join;
using nlohmann::json;
namespace st = fsdp::safetensors;

namespace {

constexpr uint64_t kCopyChunk = 64 << 20;

// See Note [Hugging Face config].
json hf_config(const llama::LlamaConfig& c) {
  json j = c.to_json();
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["torch_dtype"] = "float32";
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["head_dim"] = c.head_dim();
  j["pretraining_tp"] = 1;
  j["rope_scaling"] = nullptr;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  j["use_cache"] = true;
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  j["pad_token_id"] = nullptr;
  return j;
}

void check_out_dir(const std::string& out) {
  if (fsdp::io::exists(out)) {
    if (!fsdp::io::is_dir(out)) throw CheckpointError("export: " + out + " exists and is not a directory");
    if (!fsdp::io::list_dir(out).empty()) {
      throw CheckpointError("export: " + out + " is not empty; export into a new or empty directory");
    }
  }
  fsdp::io::make_dirs(out);
}

// Writes out/model.safetensors with `names` (in that order) copied from the checkpoint's model
// file set; returns the data bytes written.
uint64_t write_model_file(const Checkpoint& ckpt, const std::vector<std::string>& names, const std::string& path) {
  const FileSet& model = ckpt.model();
  std::vector<st::TensorSpec> specs;
  for (const auto& n : names) {
    const auto& e = model.tensors.at(n).entry;
    specs.push_back({n, e.dtype, e.shape});
  }
  const auto plan = st::plan_file(specs, {{"format", "pt"}});
  auto f = fsdp::io::File::open_write(path, /*create_truncate=*/true);
  f.truncate(plan.file_size);
  f.pwrite_all(plan.header_bytes.data(), plan.header_bytes.size(), 0);
  std::string buf;
  uint64_t total = 0;
  for (const auto& n : names) {
    const auto& src = model.tensors.at(n);
    const auto* dst = plan.header.find(n);
    for (uint64_t done = 0; done < src.entry.nbytes(); done += buf.size()) {
      read_bytes(ckpt.dir, src.file, src.offset + done, std::min(kCopyChunk, src.entry.nbytes() - done), buf);
      f.pwrite_all(buf.data(), buf.size(), plan.header.data_start() + dst->begin + done);
    }
    total += src.entry.nbytes();
  }
  f.sync();
  f.close();
  return total;
}

}  // namespace

int run_export(const Args& args) {
  if (args.size() != 2 || args[0].empty() || args[1].empty() || args[0][0] == '-' || args[1][0] == '-') {
    throw UsageError("export takes two arguments: the checkpoint directory and the output directory");
  }
  const Checkpoint ckpt = open_checkpoint(args[0]);
  const llama::LlamaConfig config = model_config(ckpt);
  check_llama_tensors(ckpt, config);
  const std::string out = args[1];
  check_out_dir(out);

  // Tied embeddings are stored once, under model.embed_tokens.weight (the first name); transformers
  // ties lm_head to it on load, so lm_head.weight is left out even if a checkpoint holds it.
  std::vector<std::string> names;
  for (const auto& [name, shape] : llama_tensors(config)) names.push_back(name);
  const uint64_t bytes = write_model_file(ckpt, names, join(out, "model.safetensors"));

  st::Index index;
  index.metadata = {{"total_size", bytes}};
  for (const auto& n : names) index.weight_map[n] = "model.safetensors";
  fsdp::io::write_file_atomic(join(out, "model.safetensors.index.json"), st::index_to_json(index));
  // Last: a directory with config.json is what from_pretrained takes for a model.
  fsdp::io::write_file_atomic(join(out, "config.json"), hf_config(config).dump(2) + "\n");

  std::printf("exported %zu tensors, %" PRIu64
              " bytes of %s (step %s) to %s: config.json, model.safetensors, "
              "model.safetensors.index.json\n",
              names.size(), bytes, ckpt.dir.c_str(), ckpt.state.value("step", json()).dump().c_str(), out.c_str());
  return 0;
}

int run_logits(const Args& args) {
  if (args.size() != 3) {
    throw UsageError(
        "logits takes three arguments: the checkpoint directory, an int64 .npy of tokens [B, T] and "
        "the .npy to write float32 logits [B, T, vocab] to");
  }
  const Checkpoint ckpt = open_checkpoint(args[0]);
  const llama::LlamaConfig config = model_config(ckpt);
  at::Tensor tokens = read_npy_int64(args[1]);
  if (tokens.dim() == 1) tokens = tokens.unsqueeze(0);
  if (tokens.dim() != 2 || tokens.numel() == 0) {
    throw std::invalid_argument("logits: tokens must be a non-empty [B, T] (or [T]) array, got shape " +
                                shape_text(tokens.sizes().vec()));
  }
  const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
  if (lo < 0 || hi >= config.vocab_size) {
    throw std::invalid_argument("logits: tokens must lie in [0, " + std::to_string(config.vocab_size) +
                                "), got values from " + std::to_string(lo) + " to " + std::to_string(hi));
  }
  llama::LlamaForCausalLM model(config, at::kCPU);  // random init, overwritten by the load
  fsdp::checkpoint::load_unsharded(ckpt.dir, *model);
  at::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(tokens);
  write_npy_float32(args[2], logits);
  std::printf("logits %s of %s (step %s) -> %s\n", shape_text(logits.sizes().vec()).c_str(), ckpt.dir.c_str(),
              ckpt.state.value("step", json()).dump().c_str(), args[2].c_str());
  return 0;
}

}  // namespace fsdp_ckpt
