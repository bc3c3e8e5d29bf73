// fsdp-ckpt export of a LoRA run's checkpoint (fsdp-train's lora section):
//   - by default a PEFT adapter directory: adapter_model.safetensors, the adapters under PEFT's
//     names ("base_model.model." + the model's name, "...q_proj.lora_A.weight"), and
//     adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout, target_modules, the base
//     the run imported as base_model_name_or_path), which peft's PeftModel.from_pretrained loads
//     onto the base transformers model;
//   - with --merged the Hugging Face model with each adapter folded into its weight,
//     W + (B A) * alpha / r in fp32, the base read from the checkpoint when it holds it
//     (lora.save_base) and otherwise from the directory the run imported (extra.init_from.dir).
#include <ATen/ATen.h>

#include <cinttypes>
#include <cstdio>
#include <optional>
#include <set>

#include "base/file_io.h"
#include "ckpt_export.h"
#include "fsdp/checkpoint.h"
#include "base/strings.h"
#include "fsdp/errors.h"
#include "fsdp/lora.h"
#include "hf.h"
#include "safetensors/file_set.h"
#include "safetensors/torch_dtypes.h"

namespace fsdp_ckpt {

using fsdp::CheckpointError;
using fsdp::io::join;
using nlohmann::json;
namespace st = fsdp::safetensors;

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

// The adapted modules' names ("model.layers.0.self_attn.q_proj"), in the checkpoint's order.
std::vector<std::string> adapted_modules(const Checkpoint& ckpt) {
  std::vector<std::string> out;
  for (const auto& name : ckpt.model().order) {
    fsdp::LoraWeight which = fsdp::LoraWeight::kB;
    std::string module = fsdp::lora_module_of(name, &which);
    if (!module.empty() && which == fsdp::LoraWeight::kA) out.push_back(std::move(module));
  }
  if (out.empty()) throw CheckpointError("fsdp-ckpt: " + ckpt.dir + " is a LoRA run's but holds no lora_A tensors");
  return out;
}

// Rows [first, first + count) of a tensor of the checkpoint's F32 model files (count -1: all).
at::Tensor read_f32(const Checkpoint& ckpt, const std::string& name, int64_t first = 0, int64_t count = -1) {
  const auto it = ckpt.model().tensors.find(name);
  if (it == ckpt.model().tensors.end()) throw CheckpointError("fsdp-ckpt: " + ckpt.dir + " has no tensor " + name);
  std::vector<int64_t> shape = it->second.entry.shape;
  const int64_t row = row_numel(shape);
  if (count >= 0 && !shape.empty()) shape[0] = count;
  const int64_t elems = count >= 0 ? count * row : static_cast<int64_t>(it->second.entry.nbytes() / 4);
  return read_values(ckpt.dir, it->second.file, it->second.offset + static_cast<uint64_t>(first * row) * 4, elems,
                     at::kFloat)
      .view(shape);
}

// A Hugging Face directory's tensors (the base a LoRA run imported), read a chunk of rows at a time
// as fp32.
struct HfWeights : st::FileSet {
  std::string dir;

  explicit HfWeights(const std::string& d) : dir(d) {
    const std::string label = "fsdp-ckpt: export --merged: " + join(dir, "model.safetensors.index.json");
    std::optional<st::FileSet> found = st::read_index_or_file(dir, "model.safetensors", label);
    if (!found) {
      throw CheckpointError("fsdp-ckpt: export --merged: the base model " + dir +
                            " (the run's --init-from) has no model.safetensors[.index.json]");
    }
    static_cast<st::FileSet&>(*this) = std::move(*found);
  }

  // Rows [first, first + count) of `name`, whose shape must be `shape`.
  at::Tensor read_rows(const std::string& name, const std::vector<int64_t>& shape, int64_t first, int64_t count) const {
    const auto it = index.weight_map.find(name);
    if (it == index.weight_map.end()) throw CheckpointError("fsdp-ckpt: export --merged: " + dir + " has no " + name);
    const st::Header& h = headers.at(it->second);
    const st::TensorEntry* e = h.find(name);
    if (e->shape != shape) {
      throw CheckpointError("fsdp-ckpt: export --merged: " + dir + ": " + name +
                            " does not have the checkpoint model's shape (another base model?)");
    }
    const uint64_t item = st::itemsize(e->dtype), row = static_cast<uint64_t>(row_numel(shape));
    std::vector<int64_t> rows_shape = shape;
    if (!rows_shape.empty()) rows_shape[0] = count;
    return read_values(dir, it->second, h.data_start() + e->begin + static_cast<uint64_t>(first) * row * item,
                       count * static_cast<int64_t>(row), st::to_scalar_type(e->dtype))
        .to(at::kFloat)
        .view(rows_shape);
  }
};

// PEFT's target_modules: the adapted modules' last names when the run's targets were plain names
// (PEFT matches each as a suffix), else a regular expression of exactly the adapted modules.
json peft_targets(const json& lora, const std::vector<std::string>& modules) {
  bool plain = true;
  for (const auto& t : lora.value("targets", json::array())) {
    plain = plain && t.is_string() && t.get<std::string>().find_first_of("*+?[](){}|^$\\") == std::string::npos;
  }
  if (plain) {
    std::set<std::string> last;
    for (const auto& m : modules) last.insert(m.substr(m.rfind('.') + 1));
    return json(std::vector<std::string>(last.begin(), last.end()));
  }
  std::string re;
  for (const auto& m : modules) {
    std::string escaped;
    for (char c : m) escaped += c == '.' ? std::string("\\.") : std::string(1, c);
    re += (re.empty() ? "" : "|") + escaped;
  }
  return json("(" + re + ")");
}

int export_adapter(const Checkpoint& ckpt, const ExportArgs& e, const json& lora) {
  const std::vector<std::string> modules = adapted_modules(ckpt);
  const at::ScalarType dtype = scalar_type_of(e.dtype.empty() ? "float32" : e.dtype);
  check_out_dir(e.out);  // and makes it
  std::vector<std::string> names;
  std::vector<st::TensorSpec> specs;
  for (const auto& m : modules) {
    for (const auto which : {fsdp::LoraWeight::kA, fsdp::LoraWeight::kB}) {
      const std::string name = fsdp::lora_adapter_name(m, which);
      names.push_back(name);
      specs.push_back({kPeftPrefix + name, st::from_scalar_type(dtype), ckpt.model().tensors.at(name).entry.shape});
    }
  }
  const auto plan = st::plan_file(specs, {{"format", "pt"}});
  auto f = fsdp::io::File::open_write(join(e.out, "adapter_model.safetensors"), /*create_truncate=*/true);
  f.truncate(plan.file_size);
  f.pwrite_all(plan.header_bytes.data(), plan.header_bytes.size(), 0);
  for (size_t i = 0; i < names.size(); ++i) {
    const at::Tensor t = read_f32(ckpt, names[i]).to(dtype).contiguous();
    const auto* dst = plan.header.find(specs[i].name);
    f.pwrite_all(t.data_ptr(), dst->nbytes(), plan.header.data_start() + dst->begin);
  }
  f.sync();
  f.close();
  const json& extra = ckpt.state["extra"];
  const json base = extra.contains("init_from") ? extra["init_from"].value("dir", json()) : json();
  const json config = {{"peft_type", "LORA"},
                       {"task_type", "CAUSAL_LM"},
                       {"base_model_name_or_path", base},
                       {"r", lora.value("r", 8)},
                       {"lora_alpha", lora.value("alpha", 16.0)},
                       {"lora_dropout", lora.value("dropout", 0.0)},
                       {"target_modules", peft_targets(lora, modules)},
                       {"bias", "none"},
                       {"fan_in_fan_out", false},
                       {"inference_mode", true},
                       {"init_lora_weights", true},
                       {"use_rslora", false},
                       {"use_dora", false},
                       {"modules_to_save", nullptr},
                       {"layers_to_transform", nullptr},
                       {"layers_pattern", nullptr},
                       {"rank_pattern", json::object()},
                       {"alpha_pattern", json::object()}};
  fsdp::io::write_file_atomic(join(e.out, "adapter_config.json"), config.dump(2) + "\n");
  std::printf(
      "exported the LoRA adapter of %s (step %s): %zu adapted modules, r %s, alpha %s, %s, as a PEFT "
      "adapter to %s: adapter_model.safetensors, adapter_config.json (base %s)\n",
      ckpt.dir.c_str(), ckpt.state.value("step", json()).dump().c_str(), modules.size(), config["r"].dump().c_str(),
      config["lora_alpha"].dump().c_str(), c10::toString(dtype), e.out.c_str(), base.dump().c_str());
  return 0;
}

// The merged model's rows, for write_model_files: an adapted weight's rows W[rows] + B[rows] A *
// scaling, the base's rows from the directory the run imported when the checkpoint does not hold
// it, else none (read from the checkpoint).
struct MergedRows {
  const Checkpoint& ckpt;
  const HfWeights* hf;  // null: the base is in the checkpoint
  std::set<std::string> adapted;
  double scaling;
  const Shapes& shapes;
  std::string cached_module;  // whose adapters lora_a, lora_b hold: read once for all its chunks
  at::Tensor lora_a, lora_b;

  at::Tensor operator()(const std::string& name, int64_t first, int64_t count) {
    const std::string module = fsdp::base::ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : "";
    const bool merge = adapted.count(module) != 0;
    if (!merge && hf == nullptr) return at::Tensor();
    at::Tensor w =
        hf == nullptr ? read_f32(ckpt, name, first, count) : hf->read_rows(name, shapes.at(name), first, count);
    if (!merge) return w;
    if (cached_module != module) {
      lora_a = read_f32(ckpt, fsdp::lora_adapter_name(module, fsdp::LoraWeight::kA));
      lora_b = read_f32(ckpt, fsdp::lora_adapter_name(module, fsdp::LoraWeight::kB));
      cached_module = module;
    }
    return w.addmm_(lora_b.narrow(0, first, count), lora_a, /*beta=*/1.0, /*alpha=*/scaling);
  }
};

int export_merged(const Checkpoint& ckpt, const ExportArgs& e, const json& lora) {
  const llama::LlamaConfig config = model_config(ckpt);
  const std::vector<std::string> modules = adapted_modules(ckpt);
  const double scaling = lora.value("alpha", 16.0) / static_cast<double>(lora.value("r", 8));
  const std::string dtype = e.dtype.empty() ? config.dtype : e.dtype;
  std::vector<std::string> names;
  Shapes shapes;
  for (const auto& [name, shape] : llama_tensors(config)) {
    names.push_back(name);
    shapes[name] = shape;
  }
  // The base: in the checkpoint (lora.save_base), else the directory the run imported.
  const bool in_ckpt = ckpt.model().tensors.count(names.front()) != 0;
  std::unique_ptr<HfWeights> hf;
  if (!in_ckpt) {
    const json& extra = ckpt.state["extra"];
    if (!extra.contains("init_from") || !extra["init_from"].contains("dir")) {
      throw CheckpointError("fsdp-ckpt: export --merged: " + ckpt.dir +
                            " holds the adapters only and records no base model (extra.init_from.dir)");
    }
    hf = std::make_unique<HfWeights>(extra["init_from"]["dir"].get<std::string>());
  }
  MergedRows merged{ckpt, hf.get(), std::set<std::string>(modules.begin(), modules.end()), scaling, shapes};
  const RowsFn rows = std::ref(merged);
  const std::string tokenizer_dir = tokenizer_source(e, ckpt, config);
  check_out_dir(e.out);  // and makes it
  uint64_t bytes = 0;
  std::string files = "config.json";
  for (const auto& f : write_model_files(ckpt, names, e.out, scalar_type_of(dtype), parse_shard_size(e.max_shard_size),
                                         bytes, shapes, rows))
    files += ", " + f;
  if (!tokenizer_dir.empty()) {
    for (const auto& name : copy_tokenizer_files(tokenizer_dir, e.out)) files += ", " + name;
  }
  fsdp::io::write_file_atomic(join(e.out, "config.json"), llama::hf::hf_config_json(config, dtype).dump(2) + "\n");
  std::printf(
      "exported %s (step %s) merged: %zu adapters folded in (scaling %g), the base from %s, as %s in %s "
      "to %s: %s\n",
      ckpt.dir.c_str(), ckpt.state.value("step", json()).dump().c_str(), modules.size(), scaling,
      in_ckpt ? "the checkpoint" : hf->dir.c_str(), llama::hf::architecture(config.model_type).c_str(), dtype.c_str(),
      e.out.c_str(), files.c_str());
  return 0;
}

}  // namespace

const json* lora_section(const Checkpoint& ckpt) {
  const json& s = ckpt.state;
  if (!s.is_object() || !s.contains("extra") || !s["extra"].is_object()) return nullptr;
  const json& extra = s["extra"];
  if (!extra.contains("config") || !extra["config"].is_object()) return nullptr;
  const json& cfg = extra["config"];
  if (!cfg.contains("lora") || !cfg["lora"].is_object() || !cfg["lora"].value("enabled", false)) return nullptr;
  return &cfg["lora"];
}

void load_lora_unsharded(const Checkpoint& ckpt, const json& lora, llama::LlamaForCausalLM& model) {
  at::NoGradGuard no_grad;
  const bool in_ckpt = ckpt.model().tensors.count("model.norm.weight") != 0;
  if (in_ckpt) {
    for (auto& p : model->named_parameters()) p.value().copy_(read_f32(ckpt, p.key()));
  } else {
    const json& extra = ckpt.state["extra"];
    if (!extra.contains("init_from") || !extra["init_from"].contains("dir")) {
      throw CheckpointError("fsdp-ckpt: " + ckpt.dir + " holds the adapters only and records no base model");
    }
    fsdp::checkpoint::import_unsharded(extra["init_from"]["dir"].get<std::string>(), *model);
  }
  std::vector<std::string> targets;
  for (const auto& t : lora.value("targets", json::array())) targets.push_back(t.get<std::string>());
  fsdp::lora(*model, fsdp::LoraOptions()
                         .targets(targets)
                         .r(lora.value("r", 8))
                         .alpha(lora.value("alpha", 16.0))
                         .dropout(lora.value("dropout", 0.0)));
  for (auto& p : model->named_parameters()) {
    if (fsdp::is_lora_adapter(p.key())) {
      p.value().copy_(read_f32(ckpt, p.key()));
    }
  }
}

int export_lora(const Checkpoint& ckpt, const ExportArgs& e, const json& lora) {
  return e.merged ? export_merged(ckpt, e, lora) : export_adapter(ckpt, e, lora);
}

}  // namespace fsdp_ckpt
