// Sharded save with atomic commit. Every rank runs the same phases; between phases the ranks
// agree on success (Note [Save agreement]), so a failure anywhere stops everyone before the commit.
//   prepare (rank 0): NAME.tmp/ with every file's header written and its size set (layout from the
//                     model alone);
//   write (every rank): its own shards' bytes at their offsets, fsync;
//   commit (rank 0):  indexes, then train_state.json last, fsync, rename NAME.tmp -> NAME, fsync
//                     the parent, update `latest`, drop checkpoints beyond keep_last.
// A failed save removes its NAME.tmp; the next save clears orphaned ones (Note [Orphaned saves]).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <tuple>

#include "base/strings.h"
#include "base/direct_writer.h"
#include "base/file_io.h"
#include "base/file_lock.h"
#include "safetensors/index.h"
#include "checkpoint/layout.h"
#include "safetensors/safetensors.h"
#include "safetensors/torch_dtypes.h"
#include "checkpoint/save_job.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"

namespace fsdp::checkpoint {

using namespace io;  // NOLINT: file helpers read as plain calls here

namespace {

std::function<void(const std::string&, int)>& fault_hook() {
  static std::function<void(const std::string&, int)> hook;  // tests only; see save_job.h
  return hook;
}

void fault_point(const SaveJob& job, const std::string& phase) {
  if (job.options.on_phase() && (phase == "prepare" || phase == "write" || phase == "commit")) {
    job.options.on_phase()(phase);
  }
  if (fault_hook()) fault_hook()(phase, job.group->rank());
}

// Note [Orphaned saves]
// Rank 0 lays a save out in NAME.tmp with a lock file, kLockFile, that it holds under flock(2)
// until the save ends and unlinks just after the rename that commits. A failed save's rank 0
// removes NAME.tmp once the ranks have agreed on the failure (so none writes there any more). What
// a save cannot remove itself (its process killed, its node lost) is an orphan, which the next save
// into the same folder clears: it removes each *.tmp directory there whose lock file it can lock
// at once (io::try_lock_file): never one a save of this process holds, and the kernel drops a dead
// process's lock, while a live save in another process (on another host too, where the file system
// carries locks) holds its own. A *.tmp without a lock file (not written by this fsdp) or whose
// lock cannot be taken (held, or a file system without locks) is left alone. So a save in progress
// is never removed; at worst another process's save that is creating its lock file at that very
// instant fails, as any save that loses its NAME.tmp does; nothing committed is touched.
constexpr const char* kLockFile = ".fsdp-save.lock";

void clear_orphans(const std::string& root_dir) {
  for (const auto& n : list_dir(root_dir)) {
    if (!base::ends_with(n, ".tmp")) continue;
    const std::shared_ptr<void> lock = try_lock_file(join(join(root_dir, n), kLockFile), false);
    try {
      if (lock) remove_tree(join(root_dir, n));
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): left for a later save
    }
  }
}

// A failed save's rank 0, once every rank has stopped (Note [Orphaned saves]).
void discard_tmp(SaveJob& job) {
  try {
    remove_tree(tmp_dir(job));
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): an orphan for the next save
  }
  job.lock.reset();
}

// Note [Save agreement]
// After each phase every rank contributes a flag (did my part fail?) to an all-reduce over the
// save's own communicator; a failing rank first leaves its message in the store. Every rank then
// raises the same error, naming the first failing rank, and rank 0 leaves nothing committed.
void agree(SaveJob& job, const std::string& phase, const std::string& local_error) {
  const int world = job.group->size();
  auto flags = at::zeros({world}, at::kFloat);
  const std::string key = job.store_prefix + phase + "/";
  if (!local_error.empty()) {
    flags[job.group->rank()] = 1;
    job.store->set(key + std::to_string(job.group->rank()),
                   std::vector<uint8_t>(local_error.begin(), local_error.end()));
  }
  job.group->all_reduce(flags, ReduceOp::kSum, "checkpoint/" + phase).wait();
  for (int r = 0; r < world; ++r) {
    if (flags[r].item<float>() == 0) continue;
    if (job.group->rank() == 0) discard_tmp(job);
    const auto bytes = job.store->get(key + std::to_string(r));
    throw CheckpointError("fsdp: saving checkpoint '" + job.name + "' failed on rank " + std::to_string(r) + " while " +
                          phase + ": " + std::string(bytes.begin(), bytes.end()) + " (nothing was committed)");
  }
}

template <typename F>
std::string capture(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return base::first_line(e);
  }
  return "";
}

}  // namespace

std::vector<std::string> file_kinds(const SaveJob& job) {
  std::vector<std::string> kinds{"model"};
  for (const auto& s : job.state_names) kinds.push_back("optim." + s);
  return kinds;
}

std::vector<safetensors::TensorSpec> specs_for(const SaveJob& job, const std::string& kind) {
  std::vector<safetensors::TensorSpec> specs;
  for (const auto& t : job.layout.tensors) {
    if (kind != "model" && job.layout.flats[t.flat].optim_state == nullptr) continue;
    specs.push_back({t.name, safetensors::DType::F32, t.shape});
  }
  if (kind != "model") return specs;
  for (const auto& b : job.layout.buffers) {
    specs.push_back({b.name, safetensors::from_scalar_type(b.dtype), b.tensor.sizes().vec()});
  }
  return specs;
}

safetensors::FilePlan file_plan(const SaveJob& job, const std::string& kind) {
  return safetensors::plan_file(specs_for(job, kind), {{"format", "pt"}, {"writer", "fsdp"}});
}

namespace {

// The shard tensor a file kind takes its bytes from, or undefined when this rank has none.
ShardTensor source_for(const SaveJob& job, const std::string& kind, size_t flat) {
  if (kind == "model") return job.data.params[flat];
  const auto& states = job.data.states[flat];
  auto it = states.find(kind.substr(6));  // "optim." + name
  return it == states.end() ? ShardTensor() : it->second;
}

void prepare(SaveJob& job, const std::string& tmp) {
  make_dirs(job.root_dir);
  clear_orphans(job.root_dir);
  remove_tree(tmp);  // a crashed earlier save of the same name
  make_dirs(tmp);
  job.lock = try_lock_file(join(tmp, kLockFile), true);
  for (const auto& kind : file_kinds(job)) {
    const auto plan = file_plan(job, kind);
    File f = File::open_write(join(tmp, kind + ".safetensors"), true);
    f.truncate(plan.file_size);
    f.pwrite_all(plan.header_bytes.data(), plan.header_bytes.size(), 0);
    f.close();
  }
}

// Buffers are replicated: the job's rank 0 writes them whole into the model file.
void write_buffers(SaveJob& job, const std::string& tmp) {
  if (job.layout.buffers.empty() || job.group->rank() != 0) return;
  const auto plan = file_plan(job, "model");
  File f = File::open_write(join(tmp, "model.safetensors"), false);
  for (size_t i = 0; i < job.layout.buffers.size(); ++i) {
    const at::Tensor& host = job.data.buffers[i];
    const auto* entry = plan.header.find(job.layout.buffers[i].name);
    f.pwrite_all(host.data_ptr(), host.numel() * host.element_size(), plan.header.data_start() + entry->begin);
  }
  f.sync();
  f.close();
}

}  // namespace

std::vector<Run> runs_for(const SaveJob& job, const std::string& kind, const safetensors::FilePlan& plan) {
  std::vector<Run> runs;
  for (const auto& t : job.layout.tensors) {
    if (kind != "model" && job.layout.flats[t.flat].optim_state == nullptr) continue;  // not in the file
    if (!job.layout.flats[t.flat].shard.writer) continue;                              // a replica's
    const auto span = shard_span(job.layout.flats[t.flat].shard, t);
    if (!span) continue;
    const int64_t at = static_cast<int64_t>(plan.header.data_start() + plan.header.find(t.name)->begin) +
                       span->tensor_begin * static_cast<int64_t>(sizeof(float));
    if (!runs.empty()) {
      Run& last = runs.back();
      if (last.flat == t.flat && last.shard_begin + last.count == span->shard_begin &&
          last.at + last.count * static_cast<int64_t>(sizeof(float)) == at) {
        last.count += span->count;
        continue;
      }
    }
    runs.push_back({t.flat, span->shard_begin, span->count, at});
  }
  return runs;
}

namespace {

// Each file's runs through a DirectWriter (Note [Direct writes of a checkpoint] in
// base/direct_writer.h); a disk-tier state is read by the tier's I/O threads, never through its
// mapping, whose faults would read it a page at a time.
// `written`: per flat slot, whether its runs are in the files already (SaveInStep); empty: none.
void write_shards(SaveJob& job, const std::string& tmp, const std::vector<char>& written) {
  write_buffers(job, tmp);
  for (const auto& kind : file_kinds(job)) {
    const auto plan = file_plan(job, kind);
    std::vector<Run> runs = runs_for(job, kind, plan);
    if (!written.empty()) {
      runs.erase(std::remove_if(runs.begin(), runs.end(), [&](const Run& r) { return written[r.flat] != 0; }),
                 runs.end());
    }
    if (runs.empty()) continue;  // every shard here is a replica another rank writes, or written
    DirectWriter out(join(tmp, kind + ".safetensors"));
    // A stored frozen shard's fp32 values exist from its first run to its last (drop_values set:
    // its view shows unfilled memory), one flat param's at a time as the units' runs follow.
    std::vector<size_t> first_run(job.layout.flats.size(), runs.size()), last_run(first_run);
    for (size_t i = runs.size(); i-- > 0;) first_run[runs[i].flat] = i;
    for (size_t i = 0; i < runs.size(); ++i) last_run[runs[i].flat] = i;
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& run = runs[i];
      const FlatShardView& view = job.layout.flats[run.flat].shard;
      const bool lazy = kind == "model" && view.drop_values;
      if (lazy && first_run[run.flat] == i) view.read_values();
      ShardTensor src = source_for(job, kind, run.flat);
      int64_t from = run.shard_begin;
      if (!src.defined()) {  // state not created yet: zeros
        src = ShardTensor(at::zeros({run.count}, at::kFloat));
        from = 0;
      }
      auto write = [&](const float* data, int64_t at, int64_t count) {
        out.write(data, count * static_cast<int64_t>(sizeof(float)),
                  run.at + (at - from) * static_cast<int64_t>(sizeof(float)));
      };
      src.read(from, from + run.count, write, "checkpoint '" + job.name + "' (" + kind + ")");
      if (lazy && last_run[run.flat] == i) view.drop_values();
    }
    out.finish();
  }
}

nlohmann::json train_state_json(SaveJob& job, int64_t commit_index) {
  nlohmann::json j;
  j["format_version"] = kFormatVersion;
  j["step"] = job.state.step;
  j["commit_index"] = commit_index;
  j["samples_seen"] = job.state.samples_seen;
  j["world_size"] = job.group->size();
  j["strategy"] = job.strategy;
  std::vector<std::string> rng;
  for (int r = 0; r < job.group->size(); ++r) {
    const auto bytes = job.store->get(job.store_prefix + "rng/" + std::to_string(r));
    rng.emplace_back(bytes.begin(), bytes.end());
  }
  j["rng_states"] = rng;
  j["extra"] = job.state.extra;
  nlohmann::json steps = nlohmann::json::object();
  for (const auto& t : job.layout.tensors) {
    if (job.layout.flats[t.flat].optim_state != nullptr) steps[t.name] = job.data.steps[t.flat];
  }
  j["optimizer"] = {{"type", job.optim_type}, {"state_names", job.state_names}, {"steps", steps}};
  std::vector<std::string> files;
  for (const auto& kind : file_kinds(job)) files.push_back(kind + ".safetensors");
  j["files"] = files;
  return j;
}

// A committed checkpoint of a save root, in keep_last's order (fsdp/checkpoint.h): by the step
// it records, then by commit_index; an unreadable train_state.json counts as the oldest.
struct Committed {
  int64_t step = -1, index = 0;
  std::string name;
  bool operator<(const Committed& o) const { return std::tie(step, index, name) < std::tie(o.step, o.index, o.name); }
};

std::vector<Committed> committed_in(const std::string& root_dir) {
  std::vector<Committed> out;
  for (const auto& n : list_dir(root_dir)) {
    const std::string state = join(join(root_dir, n), "train_state.json");
    if (base::ends_with(n, ".tmp") || base::ends_with(n, ".old") || !exists(state)) continue;
    Committed c{-1, 0, n};
    try {
      const auto j = nlohmann::json::parse(read_small_file(state));
      c.step = j.at("step").get<int64_t>();
      c.index = j.value("commit_index", int64_t{0});
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the oldest
    }
    out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void commit(SaveJob& job, const std::string& tmp, const std::string& final_dir) {
  int64_t commit_index = 1;
  for (const auto& c : committed_in(job.root_dir)) commit_index = std::max(commit_index, c.index + 1);
  for (const auto& kind : file_kinds(job)) {
    safetensors::Index index;
    index.metadata = {{"format_version", kFormatVersion}, {"step", job.state.step}};
    if (kind == "model") {  // the buffers, each in the dtype it is saved in: the rest are F32 masters
      index.metadata["buffers"] = nlohmann::json::object();
      for (const auto& b : job.layout.buffers) {
        index.metadata["buffers"][b.name] = safetensors::dtype_name(safetensors::from_scalar_type(b.dtype));
      }
    }
    for (const auto& spec : specs_for(job, kind)) index.weight_map[spec.name] = kind + ".safetensors";
    File f = File::open_write(join(tmp, kind + ".safetensors.index.json"), true);
    const std::string text = safetensors::index_to_json(index);
    f.pwrite_all(text.data(), text.size(), 0);
    f.sync();
  }
  {
    // Written last: its presence is what marks a directory as a committed checkpoint.
    const std::string text = train_state_json(job, commit_index).dump(2) + "\n";
    File f = File::open_write(join(tmp, "train_state.json"), true);
    f.pwrite_all(text.data(), text.size(), 0);
    f.sync();
  }
  fsync_dir(tmp);
  fault_point(job, "rename");
  const std::string old = final_dir + ".old";
  if (exists(final_dir)) {  // saving a name again (same step): keep the old one until the new lands
    remove_tree(old);
    rename_path(final_dir, old);
  }
  rename_path(tmp, final_dir);
  remove_tree(join(final_dir, kLockFile));  // (after the rename: a NAME.tmp always holds its lock file)
  job.lock.reset();
  fsync_dir(job.root_dir);
  remove_tree(old);
  fault_point(job, "latest");
  if (job.options.update_latest()) {
    write_file_atomic(join(job.root_dir, "latest"), job.name + "\n");
  }
  if (job.options.keep_last() > 0) {  // never the checkpoint just saved, nor the one `latest` names
    const std::string latest_file = join(job.root_dir, "latest");
    const std::string latest = exists(latest_file) ? base::first_line(read_small_file(latest_file)) : "";
    const std::vector<Committed> committed = committed_in(job.root_dir);
    const int excess = static_cast<int>(committed.size()) - job.options.keep_last();
    for (int i = 0; i < excess; ++i) {
      const std::string& n = committed[i].name;
      if (n != job.name && n != latest) remove_tree(join(job.root_dir, n));
    }
  }
}

// Note [Save keys]
// A save's store entries (RNG states, failure messages) live under a prefix unique to the save
// and the same on every rank: its name and the number of collectives the checkpoint's side group
// has run so far. Saves run in the same order on every rank, each one's agreements are waited
// for before the next save is made (the async saver waits for the one in flight first), and the
// comm layer counts a collective before its handle completes; so every rank counts the same
// number, and each save adds its agreements. The counter lives with the communicator, not with a
// model: two models saved over one Dist, or ranks that are threads of one process, never share one.
std::string save_key_prefix(const std::string& name, Communicator& group) {
  const CommStats stats = group.stats();
  uint64_t collectives = 0;
  for (const auto& op : stats.ops) collectives += op.calls;
  return "fsdp/ckpt/" + name + "/" + std::to_string(collectives) + "/";
}

}  // namespace

void set_fault_hook_for_testing(std::function<void(const std::string& phase, int rank)> hook) {
  fault_hook() = std::move(hook);
}

SaveJob make_save_job(const std::string& root_dir, const std::string& name, FSDPModule& root,
                      ShardedOptimizer* optimizer, const TrainState& state, const SaveOptions& options, bool copy) {
  if (name.empty() || name.find('/') != std::string::npos || name == "latest" || name == "." || name == "..") {
    throw CheckpointError("fsdp: invalid checkpoint name '" + name + "': use a plain name such as step-00000100");
  }
  SaveJob job;
  job.root_dir = root_dir;
  job.name = name;
  ModelView model = model_view(root, options.frozen_params());
  if (!options.frozen_params()) omit_frozen(model);
  job.layout = make_layout(model, optimizer);
  job.data = collect_shards(job.layout, copy);
  if (copy) {  // the snapshots hold the stored frozen shards' values: nothing to fill when writing
    for (auto& slot : job.layout.flats) slot.shard.drop_values = nullptr;
  }
  job.state = state;
  job.options = options;
  job.group = &model.dist->side_group("checkpoint");
  job.store = model.dist->store();
  job.store_prefix = save_key_prefix(name, *job.group);
  job.strategy = model.strategy;
  if (optimizer != nullptr) {
    job.optim_type = optimizer->type_name();
    job.state_names = optimizer->state_names();
  }
  job.rng = rng_state_base64();
  return job;
}

std::string tmp_dir(const SaveJob& job) { return join(job.root_dir, job.name) + ".tmp"; }

void agree_on(SaveJob& job, const std::string& phase, const std::function<void()>& work) {
  agree(job, phase, capture(work));
}

void prepare_phase(SaveJob& job) {
  agree(job, "preparing the files", capture([&] {
          fault_point(job, "prepare");
          if (job.group->rank() == 0) prepare(job, tmp_dir(job));
        }));
}

void write_phase(SaveJob& job, const std::vector<char>& written, const std::function<void()>& first) {
  // Every rank's RNG state is in the store before the agreement, so the commit finds them all.
  job.store->set(job.store_prefix + "rng/" + std::to_string(job.group->rank()),
                 std::vector<uint8_t>(job.rng.begin(), job.rng.end()));
  agree(job, "writing its shards", capture([&] {
          fault_point(job, "write");
          if (first) first();
          write_shards(job, tmp_dir(job), written);
        }));
}

void commit_phase(SaveJob& job) {
  agree(job, "committing", capture([&] {
          fault_point(job, "commit");
          if (job.group->rank() == 0) commit(job, tmp_dir(job), join(job.root_dir, job.name));
        }));
}

void run_save(SaveJob& job) {
  prepare_phase(job);
  write_phase(job, {}, nullptr);
  commit_phase(job);
}

std::string save(const std::string& root_dir, const std::string& name, FSDPModule& root, ShardedOptimizer* optimizer,
                 const TrainState& state, const SaveOptions& options) {
  SaveJob job = make_save_job(root_dir, name, root, optimizer, state, options, /*copy=*/false);
  run_save(job);
  return join(root_dir, name);
}

}  // namespace fsdp::checkpoint
