// Loading a checkpoint saved on any world size and strategy, in three stages: reading
// train_state.json (every field checked), validating the file sets against the model (every name,
// shape and dtype) and the optimizer, then copying: each rank reads only the byte ranges of its own
// shards. Nothing in the model, the optimizer or the RNG changes before the copying starts.
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "base/strings.h"
#include "base/file_io.h"
#include "safetensors/file_set.h"
#include "checkpoint/layout.h"
#include "safetensors/safetensors.h"
#include "safetensors/torch_dtypes.h"
#include "checkpoint/save_job.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/lora.h"
#include "shard/checkpoint_view.h"

namespace fsdp::checkpoint {

using namespace io;  // NOLINT: file helpers read as plain calls here

namespace {

using base::shape_text;

// One file set (e.g. "model" or "optim.exp_avg"): its validated index and headers.
struct FileSet : safetensors::FileSet {
  std::string kind;
};

FileSet open_file_set(const std::string& dir, const std::string& kind) {
  const std::string index_name = kind + ".safetensors.index.json";
  std::optional<safetensors::FileSet> read =
      safetensors::read_file_set(dir, index_name, "fsdp: checkpoint " + dir + ": " + index_name);
  if (!read) throw CheckpointError("fsdp: checkpoint " + dir + " has no " + index_name);
  FileSet set;
  static_cast<safetensors::FileSet&>(set) = std::move(*read);
  set.kind = kind;
  return set;
}

// Checks that the set holds exactly `wanted` (name -> shape, dtype): parameters and their
// optimizer state as F32, buffers in their own dtype.
struct WantedTensor {
  std::string name;
  std::vector<int64_t> shape;
  safetensors::DType dtype = safetensors::DType::F32;
  WantedTensor(std::string n, std::vector<int64_t> s, safetensors::DType d = safetensors::DType::F32)
      : name(std::move(n)), shape(std::move(s)), dtype(d) {}
};
using Wanted = std::vector<WantedTensor>;  // model order

void check_tensors(const std::string& dir, const FileSet& set, const Wanted& wanted) {
  std::set<std::string> names;
  for (const auto& w : wanted) names.insert(w.name);
  for (const auto& [name, shape, dtype] : wanted) {
    auto it = set.index.weight_map.find(name);
    if (it == set.index.weight_map.end()) {
      throw CheckpointError("fsdp: checkpoint " + dir + " (" + set.kind + ") has no tensor '" + name +
                            "' that the model has (shape " + shape_text(shape) + ")");
    }
    const auto* entry = set.headers.at(it->second).find(name);
    if (entry->dtype != dtype) {
      throw CheckpointError("fsdp: checkpoint " + dir + " (" + it->second + "): tensor '" + name + "' is " +
                            safetensors::dtype_name(entry->dtype) + " but the model's " +
                            (dtype == safetensors::DType::F32 ? "master copy" : "buffer") + " is " +
                            safetensors::dtype_name(dtype) + "; no silent cast");
    }
    if (entry->shape != shape) {
      throw CheckpointError("fsdp: checkpoint " + dir + " (" + it->second + "): tensor '" + name + "' has shape " +
                            shape_text(entry->shape) + " but the model's has shape " + shape_text(shape));
    }
  }
  for (const auto& [name, file] : set.index.weight_map) {
    if (!names.count(name)) {
      const bool adapter = is_lora_adapter(name);
      throw CheckpointError("fsdp: checkpoint " + dir + " (" + file + ") has tensor '" + name +
                            "' that the model does not have" +
                            (adapter ? ": it was saved with LoRA adapters; resume with the same LoRA settings "
                                       "(fsdp::lora, or fsdp-train's lora section)"
                                     : ""));
    }
  }
}

// Reads this rank's part of every tensor of the set into `target(flat)`.
template <typename Target>
void read_shards(const std::string& dir, const FileSet& set, const CheckpointLayout& layout, Target&& target,
                 const std::function<void(size_t flat)>& tensor_done = nullptr) {
  std::map<std::string, File> files;
  auto read = [&](const ShardedTensorView& t) {
    const ShardTensor shard = target(t.flat);
    const at::Tensor& dst = shard.values();
    if (!dst.defined()) return;
    const auto span = shard_span(layout.flats[t.flat].shard, t);
    if (!span) return;
    const std::string& file = set.index.weight_map.at(t.name);
    auto it = files.find(file);
    if (it == files.end()) it = files.emplace(file, File::open_read(join(dir, file))).first;
    const auto& header = set.headers.at(file);
    const auto* entry = header.find(t.name);
    const int64_t at_byte = header.data_start() + entry->begin + span->tensor_begin * sizeof(float);
    if (!dst.is_cpu() || dst.scalar_type() != at::kFloat) {
      // A device shard, or a state kept in bf16: in chunks through fp32 host memory.
      constexpr int64_t kChunk = 4 << 20;
      at::Tensor host = at::empty({std::min(kChunk, span->count)}, at::kFloat);
      for (int64_t a = 0; a < span->count; a += kChunk) {
        const int64_t n = std::min(kChunk, span->count - a);
        it->second.pread_all(host.data_ptr<float>(), n * sizeof(float), at_byte + a * sizeof(float));
        dst.narrow(0, span->shard_begin + a, n).copy_(host.narrow(0, 0, n));
      }
      return;
    }
    if (shard.in_file()) {  // a disk-tier state: written by its tier, not paged in through its mapping
      ShardTensor::Writer out(shard, "the checkpoint load of " + t.name);
      constexpr int64_t kChunk = 4 << 20;
      for (int64_t a = 0; a < span->count; a += kChunk) {
        const int64_t n = std::min(kChunk, span->count - a);
        at::Tensor host = at::empty({n}, at::kFloat);
        it->second.pread_all(host.data_ptr<float>(), n * sizeof(float), at_byte + a * sizeof(float));
        out.put(span->shard_begin + a, host);
      }
      out.finish();
    } else {
      it->second.pread_all(dst.data_ptr<float>() + span->shard_begin, span->count * sizeof(float), at_byte);
    }
    shard.done(span->shard_begin, span->shard_begin + span->count);  // a disk tier: read, now on disk
  };
  for (const auto& t : layout.tensors) {
    read(t);
    if (tensor_done) tensor_done(t.flat);
  }
}

// ---- reading: train_state.json, every field checked before anything else is read

struct SavedTrainState {
  std::string path;  // dir/train_state.json, for messages
  nlohmann::json json;
  TrainState state;
};

SavedTrainState read_saved_state(const std::string& dir) {
  SavedTrainState saved;
  saved.path = join(dir, "train_state.json");
  const std::string& state_path = saved.path;
  if (!exists(state_path)) {
    throw CheckpointError("fsdp: " + dir +
                          " is not a committed checkpoint (no train_state.json: the save never finished)");
  }
  nlohmann::json& j = saved.json;
  try {
    j = nlohmann::json::parse(read_small_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError("fsdp: " + state_path + " is not valid JSON: " + e.what());
  }
  const std::vector<std::string> problems = check_train_state(j, "fsdp: " + state_path + ": ");
  if (!problems.empty()) throw CheckpointError(problems.front());
  TrainState& state = saved.state;
  state.step = j.at("step").get<int64_t>();
  state.samples_seen = j.at("samples_seen").get<int64_t>();
  state.world_size = j.at("world_size").get<int>();
  state.strategy = j.at("strategy").get<std::string>();
  state.rng_states = j.at("rng_states").get<std::vector<std::string>>();
  state.extra = j.at("extra");
  return saved;
}

// Whether this rank's RNG state is restored (the world size is unchanged); a saved state that
// cannot be restored throws here, with the generator left as it was.
bool check_rng_state(const TrainState& state, const Dist& dist) {
  const bool restore_rng =
      state.world_size == dist.world_size() && static_cast<int>(state.rng_states.size()) == dist.world_size();
  if (restore_rng) {
    const std::string current = rng_state_base64();
    restore_rng_state_base64(state.rng_states[dist.rank()]);  // throws CheckpointError when invalid
    restore_rng_state_base64(current);
  }
  return restore_rng;
}

// train_state.json's "optimizer" section: the saved optimizer's type and each tensor's step count.
struct SavedOptimizer {
  std::string type = "no";
  std::map<std::string, int64_t> steps;  // by tensor name
};

SavedOptimizer read_optimizer_section(const SavedTrainState& saved_state) {
  // The schema (check_train_state) has checked every field read here.
  SavedOptimizer out;
  const nlohmann::json& saved = saved_state.json.at("optimizer");
  out.type = saved.at("type").get<std::string>();
  for (const auto& [name, v] : saved.at("steps").items()) out.steps[name] = v.get<int64_t>();
  return out;
}

// ---- validating: the file sets against the model (names, shapes, dtypes) and the optimizer

struct CheckedFiles {
  FileSet model;
  std::vector<FileSet> optim;  // one per optimizer state, in state_names() order
};

// Whether the checkpoint's model files hold the frozen parameters (a checkpoint saved with
// SaveOptions::frozen_params off holds none of them).
bool holds_frozen(const std::string& dir, const ModelView& model) {
  const FileSet set = open_file_set(dir, "model");
  for (const auto& t : model.tensors) {
    if (!model.flats[t.flat].requires_grad && set.index.weight_map.count(t.name)) return true;
  }
  return false;
}

CheckedFiles check_files(const std::string& dir, const CheckpointLayout& layout, const ShardedOptimizer* optimizer,
                         const std::string& saved_optim_type) {
  Wanted all, trainable;
  for (const auto& t : layout.tensors) {
    all.emplace_back(t.name, t.shape);
    if (layout.flats[t.flat].optim_state != nullptr) trainable.emplace_back(t.name, t.shape);
  }
  for (const auto& b : layout.buffers) {
    all.emplace_back(b.name, b.tensor.sizes().vec(), safetensors::from_scalar_type(b.dtype));
  }
  CheckedFiles files{open_file_set(dir, "model"), {}};
  check_tensors(dir, files.model, all);
  if (optimizer == nullptr) return files;
  if (saved_optim_type != optimizer->type_name()) {
    throw CheckpointError("fsdp: checkpoint " + dir + " holds " + saved_optim_type +
                          " optimizer state but the optimizer is " + optimizer->type_name());
  }
  for (const auto& name : optimizer->state_names()) {
    files.optim.push_back(open_file_set(dir, "optim." + name));
    check_tensors(dir, files.optim.back(), trainable);
  }
  return files;
}

// ---- copying: into the live tensors, once everything is validated

// Flat param by flat param, each copied into the model as soon as its last tensor is read: the
// load holds one flat param's copy at a time, not a second copy of the model. A master is read
// into a zeroed scratch shard in its own tier (a disk-tier file for a disk-tier master: no RAM
// copy), copied into the existing storage, so an offloaded state stays offloaded. A frozen one
// kept in a stored form shows fresh fp32 memory (FlatShardView::read_values set), which is zeroed
// and read into directly, then stored again and freed.
void copy_params(const std::string& dir, const FileSet& model, const CheckpointLayout& layout) {
  const size_t n = layout.flats.size();
  std::vector<ShardTensor> params(n);
  std::vector<int64_t> left(n, 0);
  for (const auto& t : layout.tensors) ++left[t.flat];
  auto copy_of = [&](size_t f) {
    const auto& slot = layout.flats[f].shard;
    if (!params[f].defined() && slot.master.defined()) {
      if (slot.read_values) {
        slot.master.values().zero_();  // the padding too, which the stored form's last block encodes
        params[f] = slot.master;
      } else {
        params[f] = slot.master.zeros_like("checkpoint load");
      }
    }
    return params[f];
  };
  auto copy_in = [&](size_t f) {
    const auto& slot = layout.flats[f].shard;
    if (!slot.master.defined()) return;  // frozen, not in the checkpoint
    if (!copy_of(f).values().is_same(slot.master.values())) slot.master.copy_from(params[f]);
    params[f] = ShardTensor();
    if (slot.master_written) slot.master_written();
  };
  for (size_t f = 0; f < n; ++f) {
    if (left[f] == 0) copy_in(f);  // no tensor of it in the layout: zeros
  }
  read_shards(dir, model, layout, copy_of, [&](size_t f) {
    if (--left[f] == 0) copy_in(f);
  });
}

// Every rank reads the buffers whole (they are replicated) and copies them in, cast to the live
// buffer's dtype.
void copy_buffers(const std::string& dir, const FileSet& model, const CheckpointLayout& layout) {
  c10::NoGradGuard no_grad;
  for (const auto& b : layout.buffers) {
    const std::string& file = model.index.weight_map.at(b.name);
    const auto& header = model.headers.at(file);
    const auto* entry = header.find(b.name);
    at::Tensor host = at::empty(b.tensor.sizes(), at::TensorOptions().dtype(b.dtype));
    File::open_read(join(dir, file)).pread_all(host.data_ptr(), entry->nbytes(), header.data_start() + entry->begin);
    b.tensor.detach().copy_(host);
  }
}

void copy_optimizer_state(const std::string& dir, const std::vector<FileSet>& optim_sets,
                          const CheckpointLayout& layout, ShardedOptimizer& optimizer,
                          const std::map<std::string, int64_t>& saved_steps) {
  for (size_t k = 0; k < optim_sets.size(); ++k) {
    const std::string name = optimizer.state_names()[k];
    read_shards(dir, optim_sets[k], layout, [&](size_t f) {
      auto* st = layout.flats[f].optim_state;
      if (st == nullptr) return ShardTensor();
      optimizer.ensure_state(*st);
      auto& t = st->tensors[name];
      if (!t.defined()) t = at::zeros_like(layout.flats[f].shard.master.values());
      return ShardTensor(t);
    });
  }
  for (const auto& t : layout.tensors) {
    auto* st = layout.flats[t.flat].optim_state;
    if (st != nullptr && saved_steps.count(t.name)) st->step = saved_steps.at(t.name);
  }
  // State never stepped when saved stays absent, as in a fresh optimizer.
  for (const auto& slot : layout.flats) {
    if (slot.optim_state != nullptr && slot.optim_state->step == 0) slot.optim_state->tensors.clear();
    if (slot.optim_state == nullptr) continue;
    for (auto& [name, t] : slot.optim_state->tensors) ShardTensor(t).done();  // a disk tier: read, now on disk
  }
}

}  // namespace

// The checkpoint name root_dir/latest holds, trimmed; empty when there is no such file.
std::string read_latest_name(const std::string& root_dir) {
  const std::string latest = join(root_dir, "latest");
  if (!exists(latest)) return "";
  std::string name = read_small_file(latest, 4096);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

bool has_latest(const std::string& root_dir) {
  const std::string name = read_latest_name(root_dir);
  return !name.empty() && exists(join(join(root_dir, name), "train_state.json"));
}

std::string resolve(const std::string& root_dir, const std::string& which) {
  std::string dir = which;
  if (which.empty() || which == "latest") {
    const std::string latest = join(root_dir, "latest");
    if (!exists(latest)) throw CheckpointError("fsdp: no checkpoint to resume: " + latest + " does not exist");
    const std::string name = read_latest_name(root_dir);
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      throw CheckpointError("fsdp: " + latest + " does not name a checkpoint directory");
    }
    dir = join(root_dir, name);
  } else if (!exists(dir) && !root_dir.empty() && exists(join(root_dir, which))) {
    dir = join(root_dir, which);
  }
  if (!exists(join(dir, "train_state.json"))) {
    throw CheckpointError("fsdp: " + dir +
                          " is not a committed checkpoint (no train_state.json: the save never finished)");
  }
  return dir;
}

TrainState read_train_state(const std::string& dir) { return read_saved_state(dir).state; }

TrainState load(const std::string& dir, FSDPModule& root, ShardedOptimizer* optimizer) {
  // Read and validate everything before changing anything: a bad field or file must not leave a
  // half-loaded model or silently dropped optimizer state.
  const SavedTrainState saved = read_saved_state(dir);
  ModelView model = model_view(root, /*frozen_values=*/false);
  if (!holds_frozen(dir, model)) omit_frozen(model);  // saved without them (SaveOptions::frozen_params)
  const CheckpointLayout layout = make_layout(model, optimizer);
  const bool restore_rng = check_rng_state(saved.state, *model.dist);
  SavedOptimizer saved_optim;
  if (optimizer != nullptr) saved_optim = read_optimizer_section(saved);
  const CheckedFiles files = check_files(dir, layout, optimizer, saved_optim.type);

  copy_params(dir, files.model, layout);
  copy_buffers(dir, files.model, layout);
  if (optimizer != nullptr) copy_optimizer_state(dir, files.optim, layout, *optimizer, saved_optim.steps);
  if (restore_rng) restore_rng_state_base64(saved.state.rng_states[model.dist->rank()]);
  return saved.state;
}

// Whether the checkpoint holds the module's frozen parameters. Saved without them
// (SaveOptions::frozen_params off: a LoRA run's adapters and nothing of its base), load_unsharded,
// as load() does, restores the trainable ones and leaves the frozen ones (the base, imported into
// the module beforehand); a module without adapters for such a checkpoint is refused.
bool holds_frozen_unsharded(const std::string& dir, const FileSet& model, torch::nn::Module& module) {
  bool adapters_in_file = false, base_in_file = false, frozen_in_file = false, module_has_adapters = false;
  for (const auto& [name, file] : model.index.weight_map)
    (is_lora_adapter(name) ? adapters_in_file : base_in_file) = true;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    module_has_adapters |= is_lora_adapter(item.key());
    if (!item.value().requires_grad() && model.index.weight_map.count(item.key())) frozen_in_file = true;
  }
  if (adapters_in_file && !module_has_adapters && !base_in_file) {
    throw CheckpointError(
        "fsdp: checkpoint " + dir +
        " holds a LoRA run's adapters only (saved with SaveOptions::frozen_params off, no base weights), and "
        "this module has no adapters to take them. Add them first: fsdp::lora(module, the run's LoraOptions) on "
        "this unsharded module, import the base into it (fsdp::checkpoint::import_unsharded of the pretrained "
        "model), then load_unsharded restores the adapters; fsdp::merge_lora folds them into the base after");
  }
  return frozen_in_file;
}

void load_unsharded(const std::string& dir, torch::nn::Module& module) {
  if (!exists(join(dir, "train_state.json"))) {
    throw CheckpointError("fsdp: " + dir + " is not a committed checkpoint (no train_state.json)");
  }
  FileSet model = open_file_set(dir, "model");
  const bool frozen_in_file = holds_frozen_unsharded(dir, model, module);
  std::map<std::string, at::Tensor> params;
  Wanted wanted;
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied: first name
    if (!frozen_in_file && !item.value().requires_grad()) continue;         // not saved: kept as it is
    params[item.key()] = item.value();
    wanted.emplace_back(item.key(), item.value().sizes().vec());
  }
  // Persistent buffers saved next to the parameters (a buffer the file lacks is non-persistent).
  std::map<std::string, at::Tensor> buffers;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (!item.value().defined() || !model.index.weight_map.count(item.key())) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const auto& header = model.headers.at(model.index.weight_map.at(item.key()));
    buffers[item.key()] = item.value();
    wanted.emplace_back(item.key(), item.value().sizes().vec(), header.find(item.key())->dtype);
  }
  check_tensors(dir, model, wanted);
  c10::NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    const std::string& file = model.index.weight_map.at(name);
    const auto& header = model.headers.at(file);
    const auto* entry = header.find(name);
    at::Tensor buf = at::empty(p.sizes(), at::kFloat);
    File::open_read(join(dir, file))
        .pread_all(buf.data_ptr<float>(), entry->nbytes(), header.data_start() + entry->begin);
    p.copy_(buf);
  }
  for (auto& [name, b] : buffers) {
    const std::string& file = model.index.weight_map.at(name);
    const auto& header = model.headers.at(file);
    const auto* entry = header.find(name);
    at::Tensor buf = at::empty(b.sizes(), safetensors::to_scalar_type(entry->dtype));
    File::open_read(join(dir, file)).pread_all(buf.data_ptr(), entry->nbytes(), header.data_start() + entry->begin);
    b.copy_(buf);
  }
}

}  // namespace fsdp::checkpoint
