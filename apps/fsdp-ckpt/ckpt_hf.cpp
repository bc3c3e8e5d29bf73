// fsdp-ckpt export and logits: a checkpoint of fsdp-train's model as a Hugging Face directory of
// its family (LlamaForCausalLM, Qwen2ForCausalLM, ...) in bfloat16, float16 or float32, and the logits of the same
// weights run unsharded in LibTorch (the reference the export is checked against, tests/interop/hf_interop_test.py),
// or of a Hugging Face model directory read as fsdp-train --init-from reads it.
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
#include <functional>
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

// export's arguments: DIR OUT and the options --dtype NAME and --tokenizer-dir DIR (or
// --opt=VALUE) anywhere.
struct ExportArgs {
  std::string dir, out, dtype, tokenizer_dir;
};

ExportArgs parse_export_args(const Args& args) {
  ExportArgs e;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    if ((args[i] == "--dtype" || args[i] == "--tokenizer-dir") && i + 1 < args.size()) {
      (args[i] == "--dtype" ? e.dtype : e.tokenizer_dir) = args[i + 1];
      ++i;
    } else if (args[i].rfind("--dtype=", 0) == 0) {
      e.dtype = args[i].substr(8);
    } else if (args[i].rfind("--tokenizer-dir=", 0) == 0) {
      e.tokenizer_dir = args[i].substr(16);
    } else if (args[i].empty() || args[i][0] == '-') {
      throw UsageError("export: unknown or incomplete option '" + args[i] + "'");
    } else {
      positional.push_back(args[i]);
    }
  }
  if (positional.size() != 2) {
    throw UsageError(
        "export takes the checkpoint directory and the output directory (and --dtype NAME, --tokenizer-dir DIR)");
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

// Note [Tokenizer files]
// export copies these from --tokenizer-dir, else from the directory the checkpoint's run started
// from (TrainState.extra.init_from.dir, recorded by fsdp-train --init-from), so that the export
// is a complete model directory for transformers (AutoTokenizer, generate). A file the source
// lacks is skipped with a note; an explicit --tokenizer-dir that is not a directory is an error,
// raised before anything is written.
constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                           "generation_config.json"};

// Where the tokenizer files come from ("" for nowhere, with a note on stdout saying why).
std::string tokenizer_source(const ExportArgs& e, const Checkpoint& ckpt, const llama::LlamaConfig& config) {
  if (!e.tokenizer_dir.empty()) {
    if (!fsdp::io::is_dir(e.tokenizer_dir)) {
      throw CheckpointError("export: --tokenizer-dir " + e.tokenizer_dir + " is not a directory");
    }
    return e.tokenizer_dir;
  }
  const json& state = ckpt.state;
  const json init =
      state.contains("extra") && state["extra"].is_object() ? state["extra"].value("init_from", json()) : json();
  if (!init.is_object() || !init.value("dir", json()).is_string()) return "";  // trained from scratch
  const std::string dir = init["dir"].get<std::string>();
  if (!fsdp::io::is_dir(dir)) {
    std::printf(
        "note: the checkpoint's --init-from directory %s no longer exists: no tokenizer files copied "
        "(pass --tokenizer-dir DIR)\n",
        dir.c_str());
    return "";
  }
  const json hf_vocab = init.value("vocab_size", json());
  if (hf_vocab.is_number_integer() && hf_vocab.get<int64_t>() < config.vocab_size) {
    std::printf(
        "note: the tokenizer files of %s are for its vocabulary of %lld tokens, the model's has %lld: "
        "pass --tokenizer-dir with the tokenizer that holds the added tokens\n",
        dir.c_str(), static_cast<long long>(hf_vocab.get<int64_t>()), static_cast<long long>(config.vocab_size));
  }
  return dir;
}

// Copies Note [Tokenizer files] from src into out; returns the names copied.
std::vector<std::string> copy_tokenizer_files(const std::string& src, const std::string& out) {
  std::vector<std::string> copied;
  for (const char* name : kTokenizerFiles) {
    const std::string from = join(src, name);
    if (!fsdp::io::exists(from)) {
      std::printf("note: %s has no %s: skipped\n", src.c_str(), name);
      continue;
    }
    fsdp::io::write_file_atomic(join(out, name), fsdp::io::read_small_file(from, uint64_t{1} << 32));
    copied.push_back(name);
  }
  return copied;
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
  const std::string tokenizer_dir = tokenizer_source(e, ckpt, config);
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
  std::string files = "config.json, model.safetensors, model.safetensors.index.json";
  if (!tokenizer_dir.empty()) {
    for (const auto& name : copy_tokenizer_files(tokenizer_dir, e.out))
      files += ", " + name + " (from " + tokenizer_dir + ")";
  }
  // Last: a directory with config.json is what from_pretrained takes for a model.
  fsdp::io::write_file_atomic(join(e.out, "config.json"), llama::hf::hf_config_json(config, dtype).dump(2) + "\n");

  std::printf("exported %zu tensors, %" PRIu64 " bytes of %s (step %s) as %s in %s to %s: %s\n", names.size(), bytes,
              ckpt.dir.c_str(), ckpt.state.value("step", json()).dump().c_str(),
              llama::hf::architecture(config.model_type).c_str(), dtype.c_str(), e.out.c_str(), files.c_str());
  return 0;
}

namespace {

// A Hugging Face model directory (config.json and safetensors, what fsdp-train --init-from reads)
// rather than an fsdp checkpoint or a save root.
bool is_hf_model_dir(const std::string& path) {
  return fsdp::io::is_dir(path) && fsdp::io::exists(join(path, "config.json")) &&
         !fsdp::io::exists(join(path, "train_state.json")) && !fsdp::io::exists(join(path, "latest"));
}

// The model `logits` runs: its config, how its weights are read, and what it is, for the report.
struct LogitsModel {
  llama::LlamaConfig config;
  std::string label;
  std::function<void(llama::LlamaForCausalLM&)> load;
};

LogitsModel logits_model(const std::string& path) {
  LogitsModel m;
  if (is_hf_model_dir(path)) {
    m.config = llama::hf::read_hf_config(path);
    m.label = path + " (" + llama::hf::architecture(m.config.model_type) + ")";
    m.load = [path](llama::LlamaForCausalLM& model) { fsdp::checkpoint::import_unsharded(path, *model); };
    return m;
  }
  const Checkpoint ckpt = open_checkpoint(path);
  m.config = model_config(ckpt);
  m.label = ckpt.dir + " (step " + ckpt.state.value("step", json()).dump() + ")";
  m.load = [dir = ckpt.dir](llama::LlamaForCausalLM& model) { fsdp::checkpoint::load_unsharded(dir, *model); };
  return m;
}

}  // namespace

int run_logits(const Args& args) {
  if (args.size() != 3) {
    throw UsageError(
        "logits takes three arguments: a checkpoint directory (or save root) or a Hugging Face model directory, "
        "an int64 .npy of tokens [B, T] and the .npy to write float32 logits [B, T, vocab] to");
  }
  const LogitsModel source = logits_model(args[0]);
  const llama::LlamaConfig& config = source.config;
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
  source.load(model);
  at::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(tokens);
  write_npy_float32(args[2], logits);
  std::printf("logits %s of %s -> %s\n", shape_text(logits.sizes().vec()).c_str(), source.label.c_str(),
              args[2].c_str());
  return 0;
}

}  // namespace fsdp_ckpt
