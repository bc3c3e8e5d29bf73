// fsdp-ckpt export and logits: a checkpoint of fsdp-train's model as a Hugging Face directory of
// its family (LlamaForCausalLM, Qwen2ForCausalLM, ...) in bfloat16, float16 or float32, and the logits of the same
// weights run unsharded in LibTorch (the reference the export is checked against, tests/hf_interop_test.py).
//
// Note [Hugging Face config]
// config.json is the trainer's model section in the family's own form (llama::hf::hf_config_json):
// architectures and model_type of the family (llama, qwen2, qwen3, mistral), and what transformers
// would otherwise fill with defaults that our model does not implement, spelled out so a future
// default change cannot alter the model: hidden_act "silu", no MLP biases, no dropout, head_dim,
// the rope parameters (transformers 5's "rope_parameters", plus "rope_theta" for transformers 4),
// no sliding-window layers for Qwen. bos/eos/pad token ids are null: the trainer has no special
// tokens, and transformers' defaults (1 and 2) would claim otherwise. "dtype" is the export's.
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
#include "hf.h"
#include "npy.h"
#include "safetensors/torch_dtypes.h"

namespace fsdp_ckpt {

using fsdp::CheckpointError;
using fsdp::io::join;
using nlohmann::json;
namespace st = fsdp::safetensors;

namespace {

constexpr uint64_t kCopyChunk = 64 << 20;

void check_out_dir(const std::string& out) {
  if (fsdp::io::exists(out)) {
    if (!fsdp::io::is_dir(out)) throw CheckpointError("export: " + out + " exists and is not a directory");
    if (!fsdp::io::list_dir(out).empty()) {
      throw CheckpointError("export: " + out + " is not empty; export into a new or empty directory");
    }
  }
  fsdp::io::make_dirs(out);
}

// Writes out/model.safetensors with `names` (in that order) copied from the checkpoint's F32 model
// file set and converted to `dtype` chunk by chunk (round to nearest even, as torch's .to());
// returns the data bytes written.
uint64_t write_model_file(const Checkpoint& ckpt, const std::vector<std::string>& names, const std::string& path,
                          at::ScalarType dtype) {
  const FileSet& model = ckpt.model();
  const st::DType out_dtype = st::from_scalar_type(dtype);
  const uint64_t out_item = st::itemsize(out_dtype);
  std::vector<st::TensorSpec> specs;
  for (const auto& n : names) specs.push_back({n, out_dtype, model.tensors.at(n).entry.shape});
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
      const int64_t count = static_cast<int64_t>(buf.size() / sizeof(float));
      const at::Tensor out = at::from_blob(buf.data(), {count}, at::kFloat).to(dtype).contiguous();
      f.pwrite_all(out.data_ptr(), count * out_item, plan.header.data_start() + dst->begin + done / 4 * out_item);
    }
    total += dst->nbytes();
  }
  f.sync();
  f.close();
  return total;
}

// export's arguments: DIR OUT and an optional --dtype NAME (or --dtype=NAME) anywhere.
struct ExportArgs {
  std::string dir, out, dtype;
};

ExportArgs parse_export_args(const Args& args) {
  ExportArgs e;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--dtype" && i + 1 < args.size()) {
      e.dtype = args[++i];
    } else if (args[i].rfind("--dtype=", 0) == 0) {
      e.dtype = args[i].substr(8);
    } else if (args[i].empty() || args[i][0] == '-') {
      throw UsageError("export: unknown or incomplete option '" + args[i] + "'");
    } else {
      positional.push_back(args[i]);
    }
  }
  if (positional.size() != 2) {
    throw UsageError("export takes the checkpoint directory and the output directory (and --dtype NAME)");
  }
  if (!e.dtype.empty() && e.dtype != "bfloat16" && e.dtype != "float16" && e.dtype != "float32") {
    throw UsageError("export: --dtype " + e.dtype + ": must be bfloat16, float16 or float32");
  }
  e.dir = positional[0];
  e.out = positional[1];
  return e;
}

at::ScalarType scalar_type_of(const std::string& dtype) {
  if (dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "float16") return at::kHalf;
  return at::kFloat;
}

}  // namespace

int run_export(const Args& args) {
  const ExportArgs e = parse_export_args(args);
  const Checkpoint ckpt = open_checkpoint(e.dir);
  const llama::LlamaConfig config = model_config(ckpt);
  check_llama_tensors(ckpt, config);
  // The model's own dtype (the one it was imported in; float32 for a model trained from scratch)
  // unless --dtype says otherwise.
  const std::string dtype = e.dtype.empty() ? config.dtype : e.dtype;
  check_out_dir(e.out);

  // Tied embeddings are stored once, under model.embed_tokens.weight (the first name); transformers
  // ties lm_head to it on load, so lm_head.weight is left out even if a checkpoint holds it.
  std::vector<std::string> names;
  for (const auto& [name, shape] : llama_tensors(config)) names.push_back(name);
  const uint64_t bytes = write_model_file(ckpt, names, join(e.out, "model.safetensors"), scalar_type_of(dtype));

  st::Index index;
  index.metadata = {{"total_size", bytes}};
  for (const auto& n : names) index.weight_map[n] = "model.safetensors";
  fsdp::io::write_file_atomic(join(e.out, "model.safetensors.index.json"), st::index_to_json(index));
  // Last: a directory with config.json is what from_pretrained takes for a model.
  fsdp::io::write_file_atomic(join(e.out, "config.json"), llama::hf::hf_config_json(config, dtype).dump(2) + "\n");

  std::printf("exported %zu tensors, %" PRIu64
              " bytes of %s (step %s) as %s in %s to %s: config.json, model.safetensors, "
              "model.safetensors.index.json\n",
              names.size(), bytes, ckpt.dir.c_str(), ckpt.state.value("step", json()).dump().c_str(),
              llama::hf::architecture(config.model_type).c_str(), dtype.c_str(), e.out.c_str());
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
