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

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "base/file_io.h"
#include "safetensors/index.h"
#include "ckpt_commands.h"
#include "ckpt_export.h"
#include "ckpt_view.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/plan.h"
#include "hf.h"
#include "npy.h"
#include "safetensors/torch_dtypes.h"

namespace fsdp_ckpt {

using fsdp::CheckpointError;
using fsdp::io::join;
using nlohmann::json;
namespace st = fsdp::safetensors;

void check_out_dir(const std::string& out) {
  if (fsdp::io::exists(out)) {
    if (!fsdp::io::is_dir(out)) throw CheckpointError("export: " + out + " exists and is not a directory");
    if (!fsdp::io::list_dir(out).empty()) {
      throw CheckpointError("export: " + out + " is not empty; export into a new or empty directory");
    }
  }
  fsdp::io::make_dirs(out);
}

int64_t row_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

at::Tensor read_values(const std::string& dir, const std::string& file, uint64_t offset, int64_t count,
                       at::ScalarType dtype) {
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(dtype));
  read_bytes_into(dir, file, offset, static_cast<uint64_t>(t.nbytes()), t.data_ptr());
  return t;
}

// Writes the safetensors file `path` with `names` (in that order) converted to `dtype` (round to
// nearest even, as torch's .to()), a chunk of rows at a time (Note [The load and the save] counts
// its window): each chunk from `rows` when it gives one, else read from the checkpoint's F32 model
// file set. Returns the data bytes written.
uint64_t write_model_file(const Checkpoint& ckpt, const std::vector<std::string>& names, const std::string& path,
                          at::ScalarType dtype, const Shapes& shapes, const RowsFn& rows) {
  const st::DType out_dtype = st::from_scalar_type(dtype);
  const uint64_t out_item = st::itemsize(out_dtype);
  std::vector<st::TensorSpec> specs;
  for (const auto& n : names) specs.push_back({n, out_dtype, shapes.at(n)});
  const auto plan = st::plan_file(specs, {{"format", "pt"}});
  auto f = fsdp::io::File::open_write(path, /*create_truncate=*/true);
  f.truncate(plan.file_size);
  f.pwrite_all(plan.header_bytes.data(), plan.header_bytes.size(), 0);
  uint64_t total = 0;
  for (const auto& n : names) {
    const auto* dst = plan.header.find(n);
    total += dst->nbytes();
    const std::vector<int64_t>& shape = shapes.at(n);
    const int64_t row = row_numel(shape), row_count = shape.empty() ? 1 : shape[0];
    if (row == 0) continue;
    const int64_t per_chunk = std::max<int64_t>(1, fsdp::kExportChunkBytes / 4 / row);
    for (int64_t first = 0; first < row_count; first += per_chunk) {
      const int64_t count = std::min(per_chunk, row_count - first);
      const uint64_t begin = static_cast<uint64_t>(first * row), elems = static_cast<uint64_t>(count * row);
      at::Tensor values = rows ? rows(n, first, count) : at::Tensor();
      if (!values.defined()) {
        const auto& src = ckpt.model().tensors.at(n);
        values = read_values(ckpt.dir, src.file, src.offset + begin * 4, static_cast<int64_t>(elems), at::kFloat);
      }
      const at::Tensor out = values.reshape({-1}).to(dtype).contiguous();
      if (static_cast<uint64_t>(out.numel()) != elems) {
        throw CheckpointError("export: " + n + ": a chunk of " + std::to_string(count) + " rows gave " +
                              std::to_string(out.numel()) + " values, expected " + std::to_string(elems));
      }
      f.pwrite_all(out.data_ptr(), elems * out_item, plan.header.data_start() + dst->begin + begin * out_item);
    }
  }
  f.sync();
  f.close();
  return total;
}

// Note [Export shards]
// As transformers' save_pretrained splits a model: the tensors in order, a new file when the next
// one would take the current file over max_shard_size, a tensor larger than that alone in a file
// of its own; the files are model-00001-of-0000N.safetensors with model.safetensors.index.json
// naming each tensor's file (metadata.total_size: the tensors' bytes), and a model that fits in one
// file is model.safetensors alone, without an index. The default is transformers' (5.x: "50GB").

// Bytes of a size as transformers' save_pretrained takes it (convert_file_size_to_int): an
// integer, or an integer with KB, MB, GB (powers of 10; a lowercase final "b" is bits, as there)
// or KiB, MiB, GiB (powers of 2), the unit in any case.
uint64_t parse_shard_size(const std::string& text) {
  auto fail = [&]() -> uint64_t {
    throw UsageError("export: --max-shard-size " + text +
                     ": expected bytes or an integer with a unit, e.g. 2GB, 500MB, 1GiB");
  };
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0 || digits > 15) return fail();
  const uint64_t n = std::stoull(text.substr(0, digits));
  std::string unit = text.substr(digits);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::vector<std::pair<std::string, uint64_t>> units{{"", 1},
                                                            {"KB", 1000},
                                                            {"MB", 1000000},
                                                            {"GB", 1000000000},
                                                            {"KIB", 1ull << 10},
                                                            {"MIB", 1ull << 20},
                                                            {"GIB", 1ull << 30}};
  for (const auto& [name, scale] : units) {
    if (unit != name) continue;
    if (n > UINT64_MAX / scale) return fail();
    const uint64_t bytes = n * scale;
    const bool bits = name.size() == 2 && text.back() == 'b';
    if (bytes / (bits ? 8 : 1) == 0) return fail();
    return bits ? bytes / 8 : bytes;
  }
  return fail();
}

// The files' tensors, Note [Export shards].
std::vector<std::vector<std::string>> split_into_shards(const std::vector<std::string>& names,
                                                        const std::vector<uint64_t>& bytes, uint64_t max_bytes) {
  std::vector<std::vector<std::string>> shards;
  std::vector<std::string> current;
  uint64_t current_bytes = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    if (bytes[i] > max_bytes) {
      shards.push_back({names[i]});
      continue;
    }
    if (!current.empty() && current_bytes + bytes[i] > max_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(names[i]);
    current_bytes += bytes[i];
  }
  if (!current.empty()) shards.push_back(std::move(current));
  return shards;
}

std::vector<std::string> write_model_files(const Checkpoint& ckpt, const std::vector<std::string>& names,
                                           const std::string& out, at::ScalarType dtype, uint64_t max_bytes,
                                           uint64_t& total, const Shapes& shapes, const RowsFn& rows) {
  const uint64_t item = st::itemsize(st::from_scalar_type(dtype));
  std::vector<uint64_t> bytes;
  for (const auto& n : names) {
    uint64_t count = 1;
    for (const int64_t d : shapes.at(n)) count *= static_cast<uint64_t>(d);
    bytes.push_back(count * item);
  }
  const auto shards = split_into_shards(names, bytes, max_bytes);
  std::vector<std::string> files;
  st::Index index;
  total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    files.push_back(shards.size() == 1 ? "model.safetensors" : name);
    total += write_model_file(ckpt, shards[i], join(out, files.back()), dtype, shapes, rows);
    for (const auto& n : shards[i]) index.weight_map[n] = files.back();
  }
  if (shards.size() > 1) {
    index.metadata = {{"total_size", total}};
    fsdp::io::write_file_atomic(join(out, "model.safetensors.index.json"), st::index_to_json(index));
    files.push_back("model.safetensors.index.json");
  }
  return files;
}

// export's arguments: DIR OUT and the options --dtype NAME, --tokenizer-dir DIR and
// --max-shard-size SIZE (or --opt=VALUE) anywhere.
ExportArgs parse_export_args(const Args& args) {
  ExportArgs e;
  const std::vector<std::pair<std::string, std::string*>> options{
      {"--dtype", &e.dtype}, {"--tokenizer-dir", &e.tokenizer_dir}, {"--max-shard-size", &e.max_shard_size}};
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    bool taken = false;
    for (const auto& [flag, value] : options) {
      if (args[i] == flag && i + 1 < args.size()) {
        *value = args[++i];
      } else if (args[i].rfind(flag + "=", 0) == 0) {
        *value = args[i].substr(flag.size() + 1);
      } else {
        continue;
      }
      taken = true;
      break;
    }
    if (taken) continue;
    if (args[i] == "--merged") {
      e.merged = true;
      continue;
    }
    if (args[i].empty() || args[i][0] == '-')
      throw UsageError("export: unknown or incomplete option '" + args[i] + "'");
    positional.push_back(args[i]);
  }
  if (positional.size() != 2) {
    throw UsageError(
        "export takes the checkpoint directory and the output directory (and --dtype NAME, --tokenizer-dir DIR, "
        "--merged, "
        "--max-shard-size SIZE)");
  }
  if (!e.dtype.empty() && e.dtype != "bfloat16" && e.dtype != "float16" && e.dtype != "float32") {
    throw UsageError("export: --dtype " + e.dtype + ": must be bfloat16, float16 or float32");
  }
  parse_shard_size(e.max_shard_size);  // refused now, before anything is read
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

int run_export(const Args& args) {
  const ExportArgs e = parse_export_args(args);
  const Checkpoint ckpt = open_checkpoint(e.dir);
  if (const json* lora = lora_section(ckpt)) return export_lora(ckpt, e, *lora);
  if (e.merged) throw UsageError("export --merged: " + ckpt.dir + " is not a LoRA run's checkpoint (nothing to merge)");
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
  Shapes shapes;
  for (const auto& [name, shape] : llama_tensors(config)) {
    names.push_back(name);
    shapes[name] = shape;
  }
  uint64_t bytes = 0;
  std::string files = "config.json";
  for (const auto& f :
       write_model_files(ckpt, names, e.out, scalar_type_of(dtype), parse_shard_size(e.max_shard_size), bytes, shapes))
    files += ", " + f;
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
  if (const json* lora = lora_section(ckpt)) {
    m.label += ", LoRA";
    m.load = [ckpt, lora = *lora](llama::LlamaForCausalLM& model) { load_lora_unsharded(ckpt, lora, model); };
    return m;
  }
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
