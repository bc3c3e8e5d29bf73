// See ckpt_view.h. File-system work goes through base/file_io.h: see Note [No
// std::filesystem next to libtorch.so].
#include "ckpt_view.h"

#include <algorithm>
#include <optional>
#include <set>
#include <stdexcept>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "base/strings.h"
#include "fsdp/errors.h"

namespace fsdp_ckpt {

using fsdp::CheckpointError;
using fsdp::io::exists;
using fsdp::io::join;
namespace st = fsdp::safetensors;

namespace {

constexpr const char* kIndexSuffix = ".safetensors.index.json";
constexpr uint64_t kReadChunk = 64 << 20;

}  // namespace

uint64_t FileSet::data_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, t] : tensors) total += t.entry.nbytes();
  return total;
}

const FileSet* Checkpoint::find(const std::string& kind) const {
  for (const auto& s : sets) {
    if (s.kind == kind) return &s;
  }
  return nullptr;
}

const FileSet& Checkpoint::model() const {
  const FileSet* m = find("model");
  if (m == nullptr) throw CheckpointError("checkpoint " + dir + " has no model.safetensors.index.json");
  return *m;
}

std::string resolve_dir(const std::string& path) {
  if (!fsdp::io::is_dir(path)) {
    throw CheckpointError(path + " is not a checkpoint: " + (exists(path) ? "not a directory" : "no such directory"));
  }
  if (exists(join(path, "train_state.json"))) return path;
  if (exists(join(path, "latest"))) return fsdp::checkpoint::resolve(path, "latest");
  throw CheckpointError(path +
                        " is not a checkpoint: it has neither train_state.json (a committed "
                        "checkpoint; a save that never finished has none) nor latest (a save root)");
}

std::vector<std::string> file_set_kinds(const std::string& dir) {
  std::vector<std::string> kinds;
  for (const auto& name : fsdp::io::list_dir(dir)) {
    if (fsdp::base::ends_with(name, kIndexSuffix) && name.size() > std::string(kIndexSuffix).size()) {
      kinds.push_back(name.substr(0, name.size() - std::string(kIndexSuffix).size()));
    }
  }
  std::stable_partition(kinds.begin(), kinds.end(), [](const std::string& k) { return k == "model"; });
  return kinds;
}

nlohmann::json read_train_state(const std::string& dir) {
  const std::string path = join(dir, "train_state.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(fsdp::io::read_small_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(path + " is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw CheckpointError(path + " is not a JSON object");
  return j;
}

FileSet open_file_set(const std::string& dir, const std::string& kind) {
  FileSet set;
  set.kind = kind;
  std::optional<st::FileSet> read =
      st::read_file_set(dir, set.index_name(), "checkpoint " + dir + ": " + set.index_name());
  if (!read) throw CheckpointError("checkpoint " + dir + " has no " + set.index_name());
  static_cast<st::FileSet&>(set) = std::move(*read);
  for (const auto& [file, header] : set.headers) {
    for (const auto& e : header.tensors) {
      set.tensors[e.name] = TensorLocation{file, header.data_start() + e.begin, e};
      set.order.push_back(e.name);
    }
  }
  return set;
}

Checkpoint open_checkpoint(const std::string& path) {
  Checkpoint ckpt;
  ckpt.dir = resolve_dir(path);
  ckpt.state = read_train_state(ckpt.dir);
  for (const auto& kind : file_set_kinds(ckpt.dir)) ckpt.sets.push_back(open_file_set(ckpt.dir, kind));
  ckpt.model();  // throws when there is none
  return ckpt;
}

void read_bytes_into(const std::string& dir, const std::string& file, uint64_t offset, uint64_t bytes, void* out) {
  auto f = fsdp::io::File::open_read(join(dir, file));
  for (uint64_t done = 0; done < bytes; done += std::min(kReadChunk, bytes - done)) {
    f.pread_all(static_cast<char*>(out) + done, std::min(kReadChunk, bytes - done), offset + done);
  }
}

void read_bytes(const std::string& dir, const std::string& file, uint64_t offset, uint64_t bytes, std::string& out) {
  out.resize(bytes);
  read_bytes_into(dir, file, offset, bytes, out.data());
}

llama::LlamaConfig model_config(const Checkpoint& ckpt) {
  const std::string where = ckpt.dir + "/train_state.json";
  const auto& s = ckpt.state;
  if (!s.contains("extra") || !s["extra"].is_object() || !s["extra"].contains("config") ||
      !s["extra"]["config"].is_object() || !s["extra"]["config"].contains("model")) {
    throw CheckpointError(where +
                          " has no model config (extra.config.model): only checkpoints "
                          "saved by fsdp-train record the model they hold");
  }
  try {
    return llama::LlamaConfig::from_json(s["extra"]["config"]["model"]);
  } catch (const std::invalid_argument& e) {
    throw CheckpointError(where + ": extra.config.model is not a valid LlamaConfig: " + e.what());
  }
}

std::vector<std::pair<std::string, std::vector<int64_t>>> llama_tensors(const llama::LlamaConfig& config) {
  llama::LlamaForCausalLM model(config, at::kMeta);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  std::set<const void*> seen;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied: first name wins
    out.emplace_back(item.key(), item.value().sizes().vec());
  }
  return out;
}

void check_llama_tensors(const Checkpoint& ckpt, const llama::LlamaConfig& config) {
  const FileSet& model = ckpt.model();
  std::set<std::string> wanted;
  for (const auto& [name, shape] : llama_tensors(config)) {
    wanted.insert(name);
    auto it = model.tensors.find(name);
    if (it == model.tensors.end()) {
      throw CheckpointError("checkpoint " + ckpt.dir + " (model) has no tensor '" + name +
                            "' that LlamaForCausalLM of its config has (shape " + shape_text(shape) + ")");
    }
    const auto& e = it->second.entry;
    if (e.dtype != st::DType::F32 || e.shape != shape) {
      throw CheckpointError("checkpoint " + ckpt.dir + " (" + it->second.file + "): tensor '" + name + "' is " +
                            st::dtype_name(e.dtype) + " " + shape_text(e.shape) +
                            " but LlamaForCausalLM of its config has F32 " + shape_text(shape));
    }
  }
  for (const auto& [name, t] : model.tensors) {
    if (wanted.count(name)) continue;
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;  // the tied copy, stored twice
    throw CheckpointError("checkpoint " + ckpt.dir + " (" + t.file + ") has tensor '" + name +
                          "' that LlamaForCausalLM of its config does not have");
  }
}

}  // namespace fsdp_ckpt
