// fsdp-ckpt info and verify: what a checkpoint holds, and whether every byte of it is sound.
//
// Note [What verify checks]
// verify runs every check fsdp::checkpoint::load would run and more, without a model or a process
// group, and reports every problem it finds rather than the first:
//   - train_state.json: valid JSON that holds the library's schema (fsdp::checkpoint::
//     check_train_state, Note [train_state.json schema]: every field save() writes, each of the
//     right type and range);
//   - the file sets: model plus exactly one optim.<state> per optimizer state name, and the same
//     files as train_state.json "files";
//   - each file set: its index parses, every header parses (Note [Safetensors validation]), and
//     index and headers agree (check_index_against_headers);
//   - model tensors are F32 master weights, except buffers, which are saved in their own dtype:
//     each has the dtype the model index records for it (metadata.buffers); an index without
//     that record (saved before fsdp kept it) lets a tensor that is not trainable keep its dtype;
//     every optimizer file set holds exactly the trainable tensors (the keys of optimizer.steps),
//     each with the model tensor's dtype and shape;
//   - when fsdp-train saved it (extra.config.model): the model tensors are those of
//     LlamaForCausalLM of that config;
//   - every byte of every file reads back (short files, IO errors).
#include <cinttypes>
#include <cstdio>
#include <set>

#include "base/strings.h"
#include "base/file_io.h"
#include "ckpt_commands.h"
#include "ckpt_view.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/options.h"

namespace fsdp_ckpt {

using fsdp::CheckpointError;
using fsdp::io::join;
using nlohmann::json;
namespace st = fsdp::safetensors;

namespace {

std::string field_text(const json& j, const char* key) {
  return j.contains(key) ? (j[key].is_string() ? j[key].get<std::string>() : j[key].dump()) : "(missing)";
}

std::string mib(uint64_t bytes) { return fsdp::base::mib(static_cast<int64_t>(bytes), 3); }

std::string one_dir_arg(const Args& args, const char* command) {
  if (args.size() != 1 || args[0].empty() || args[0][0] == '-') {
    throw UsageError(std::string(command) +
                     " takes one argument, the checkpoint directory (or a save root with 'latest')");
  }
  return args[0];
}

// Collects problems instead of stopping at the first.
struct Problems {
  std::vector<std::string> lines;

  void add(const std::string& what) { lines.push_back(what); }
  template <typename F>
  void check(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      lines.push_back(e.what());
    }
  }
};

// The train_state.json fields that the file-set checks need, as far as they could be read.
struct StateFields {
  bool has_optimizer = false;
  std::vector<std::string> state_names;
  std::set<std::string> trainable;  // keys of optimizer.steps
  bool has_files = false;
  std::set<std::string> files;
};

// Checks train_state.json against the library's schema (Note [train_state.json schema]), adding
// every problem, and reads the fields the file-set checks need, as far as they are readable.
StateFields check_train_state(const std::string& dir, const json& s, Problems& problems) {
  for (const auto& p : fsdp::checkpoint::check_train_state(s, join(dir, "train_state.json") + ": ")) problems.add(p);
  StateFields out;
  const json& o = s.contains("optimizer") ? s["optimizer"] : json();
  out.has_optimizer = o.is_object();
  if (out.has_optimizer && o.contains("state_names") && o["state_names"].is_array()) {
    for (const auto& n : o["state_names"])
      if (n.is_string() && !n.get<std::string>().empty()) out.state_names.push_back(n.get<std::string>());
  }
  if (out.has_optimizer && o.contains("steps") && o["steps"].is_object()) {
    for (const auto& [name, step] : o["steps"].items()) out.trainable.insert(name);
  }
  const json& f = s.contains("files") ? s["files"] : json();
  out.has_files = f.is_array();
  for (const auto& name : f) out.has_files = out.has_files && name.is_string();
  if (out.has_files)
    for (const auto& name : f) out.files.insert(name.get<std::string>());
  return out;
}

// Which file sets there must be, and that train_state.json "files" names exactly theirs.
void check_file_set_kinds(const std::string& dir, const std::vector<std::string>& kinds, const StateFields& fields,
                          Problems& problems) {
  const std::string where = "checkpoint " + dir + ": ";
  std::set<std::string> found(kinds.begin(), kinds.end());
  std::set<std::string> expected{"model"};
  for (const auto& n : fields.state_names) expected.insert("optim." + n);
  for (const auto& k : expected) {
    if (!found.count(k)) problems.add(where + k + ".safetensors.index.json is missing");
  }
  for (const auto& k : found) {
    if (!expected.count(k) && fields.has_optimizer) {
      problems.add(where + k + ".safetensors.index.json is neither the model's nor one of optimizer.state_names'");
    }
  }
  if (!fields.has_files) return;
  for (const auto& f : fields.files) {
    if (!fsdp::io::exists(join(dir, f))) problems.add(where + "train_state.json lists " + f + ", which does not exist");
  }
}

void check_optimizer_set(const std::string& dir, const FileSet& model, const FileSet& set, const StateFields& fields,
                         Problems& problems) {
  const std::string where = "checkpoint " + dir + " (";
  for (const auto& name : set.order) {
    const auto& t = set.tensors.at(name);
    auto m = model.tensors.find(name);
    if (m == model.tensors.end()) {
      problems.add(where + t.file + "): tensor '" + name + "' is not in the model file set");
    } else if (m->second.entry.dtype != t.entry.dtype || m->second.entry.shape != t.entry.shape) {
      problems.add(where + t.file + "): tensor '" + name + "' is " + st::dtype_name(t.entry.dtype) + " " +
                   shape_text(t.entry.shape) + " but the model's is " + st::dtype_name(m->second.entry.dtype) + " " +
                   shape_text(m->second.entry.shape));
    }
    if (fields.has_optimizer && !fields.trainable.count(name)) {
      problems.add(where + t.file + "): tensor '" + name +
                   "' is not trainable (not in train_state.json optimizer.steps)");
    }
  }
  for (const auto& name : fields.trainable) {
    if (!set.tensors.count(name)) {
      problems.add(where + set.index_name() + "): trainable tensor '" + name + "' (in optimizer.steps) is missing");
    }
  }
}

// Reads every byte of every file of the set; returns the bytes read.
uint64_t read_everything(const std::string& dir, const FileSet& set) {
  uint64_t total = 0;
  std::string buf;
  for (const auto& [file, header] : set.headers) {
    const uint64_t size = fsdp::io::File::open_read(join(dir, file)).size();
    uint64_t end = header.data_start();
    for (const auto& e : header.tensors) end = std::max(end, header.data_start() + e.end);
    if (size != end) {
      throw CheckpointError(join(dir, file) + " is " + std::to_string(size) + " bytes but its header describes " +
                            std::to_string(end));
    }
    for (uint64_t off = 0; off < size; off += buf.size())
      read_bytes(dir, file, off, std::min<uint64_t>(size - off, 16 << 20), buf);
    total += size;
  }
  return total;
}

}  // namespace

int run_info(const Args& args) {
  const Checkpoint ckpt = open_checkpoint(one_dir_arg(args, "info"));
  const json& s = ckpt.state;
  std::printf("checkpoint %s\n", ckpt.dir.c_str());
  uint64_t total_bytes = 0, total_tensors = 0;
  for (const auto& set : ckpt.sets) {
    std::printf("\n%s (%s): %zu tensors, %" PRIu64 " bytes (%s)\n", set.kind.c_str(), set.index_name().c_str(),
                set.tensors.size(), set.data_bytes(), mib(set.data_bytes()).c_str());
    size_t width = 4;
    for (const auto& n : set.order) width = std::max(width, n.size());
    std::printf("  %-*s  %-5s  %-16s  %12s  %s\n", static_cast<int>(width), "name", "dtype", "shape", "bytes", "file");
    for (const auto& n : set.order) {
      const auto& t = set.tensors.at(n);
      std::printf("  %-*s  %-5s  %-16s  %12" PRIu64 "  %s\n", static_cast<int>(width), n.c_str(),
                  st::dtype_name(t.entry.dtype), shape_text(t.entry.shape).c_str(), t.entry.nbytes(), t.file.c_str());
    }
    total_bytes += set.data_bytes();
    total_tensors += set.tensors.size();
  }
  std::printf("\ntotal: %" PRIu64 " tensors, %" PRIu64 " bytes (%s) in %zu file sets\n", total_tensors, total_bytes,
              mib(total_bytes).c_str(), ckpt.sets.size());
  std::string optimizer = "(missing)";
  if (s.contains("optimizer") && s["optimizer"].is_object()) {
    const json& o = s["optimizer"];
    optimizer = field_text(o, "type");
    if (o.contains("state_names") && o["state_names"].is_array()) {
      std::string names;
      for (const auto& n : o["state_names"])
        names += (names.empty() ? "" : ", ") + (n.is_string() ? n.get<std::string>() : n.dump());
      optimizer += " (states: " + names + ")";
    }
  }
  std::printf("\ntrain_state:\n");
  std::printf("  step            %s\n", field_text(s, "step").c_str());
  std::printf("  samples_seen    %s\n", field_text(s, "samples_seen").c_str());
  std::printf("  world_size      %s\n", field_text(s, "world_size").c_str());
  std::printf("  strategy        %s\n", field_text(s, "strategy").c_str());
  std::printf("  format_version  %s\n", field_text(s, "format_version").c_str());
  std::printf("  optimizer       %s\n", optimizer.c_str());
  return 0;
}

int run_verify(const Args& args) {
  const std::string dir = resolve_dir(one_dir_arg(args, "verify"));
  Problems problems;
  StateFields fields;
  json state;  // stays null when train_state.json cannot be read (a problem already recorded)
  problems.check([&] { state = read_train_state(dir); });
  if (!state.is_null()) fields = check_train_state(dir, state, problems);
  const auto kinds = file_set_kinds(dir);
  check_file_set_kinds(dir, kinds, fields, problems);
  std::vector<FileSet> sets;
  for (const auto& kind : kinds) problems.check([&] { sets.push_back(open_file_set(dir, kind)); });
  const FileSet* model = nullptr;
  std::set<std::string> set_files;
  for (const auto& set : sets) {
    if (set.kind == "model") model = &set;
    for (const auto& [file, header] : set.headers) set_files.insert(file);
  }
  if (fields.has_files) {
    for (const auto& f : set_files) {
      if (!fields.files.count(f)) problems.add("checkpoint " + dir + ": " + f + " is not in train_state.json files");
    }
  }
  if (model != nullptr) {
    const json& meta = model->index.metadata;
    const bool recorded = meta.contains("buffers") && meta["buffers"].is_object();
    for (const auto& name : model->order) {
      const auto& t = model->tensors.at(name);
      const std::string is =
          "checkpoint " + dir + " (" + t.file + "): tensor '" + name + "' is " + st::dtype_name(t.entry.dtype);
      if (recorded && meta["buffers"].contains(name)) {
        if (meta["buffers"][name] != st::dtype_name(t.entry.dtype))
          problems.add(is + "; the index records the buffer as " + meta["buffers"][name].dump());
      } else if (t.entry.dtype != st::DType::F32 && (recorded || fields.trainable.count(name))) {
        problems.add(is + "; model tensors other than buffers are F32 master weights");
      }
    }
    for (const auto& set : sets) {
      if (set.kind != "model") check_optimizer_set(dir, *model, set, fields, problems);
    }
    if (state.contains("extra") && state["extra"].is_object() && state["extra"].contains("config")) {
      problems.check([&] {
        const Checkpoint ckpt{dir, state, {*model}};
        check_llama_tensors(ckpt, model_config(ckpt));
      });
    }
  }
  uint64_t tensors = 0, bytes = 0;  // bytes: every safetensors file read in full, headers included
  for (const auto& set : sets) {
    tensors += set.tensors.size();
    problems.check([&] { bytes += read_everything(dir, set); });
  }
  if (!problems.lines.empty()) {
    for (const auto& line : problems.lines) std::fprintf(stderr, "fsdp-ckpt: verify: %s\n", line.c_str());
    std::fprintf(stderr, "fsdp-ckpt: verify: FAILED: %zu problem(s) in %s\n", problems.lines.size(), dir.c_str());
    return 1;
  }
  std::printf("ok: %" PRIu64 " tensors, %" PRIu64 " bytes in %zu file sets (%s)\n", tensors, bytes, sets.size(),
              dir.c_str());
  return 0;
}

}  // namespace fsdp_ckpt
