// fsdp-ckpt diff: are two checkpoints the same training state?
//
// Note [What diff compares]
// Equal means: the same file sets; in each, the same tensor names with the same dtypes and shapes
// and byte-identical data (so -0.0 vs 0.0 or two NaN payloads count as different: a resumed run
// that is really identical reproduces the bytes); and train_state.json equal field by field,
// extra included, except:
//   - rng_states, always: each process's CPU generator state, which fsdp-train does not draw
//     from for anything that reaches the tensors (init and data order are keyed by seed and
//     step), and which depends on how many ranks ran;
//   - commit_index, always: the checkpoint's place among the commits into its save root (for
//     SaveOptions::keep_last), which says nothing of the training state;
//   - world_size and strategy, with --ignore-world, to compare runs of one job on different
//     world sizes or sharding strategies. A trainer also records those in extra (e.g. fsdp-train's
//     extra.config.fsdp and extra.config.data.batch_size_per_rank); leave those out with
//     --ignore /extra/config/fsdp etc.;
//   - any JSON pointer given with --ignore (the field and everything under it).
// Exit status: 0 equal, 1 different, 2 bad usage or a checkpoint that cannot be read (as diff(1)).
#include <ATen/ATen.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "safetensors/torch_dtypes.h"
#include "ckpt_commands.h"
#include "ckpt_view.h"

namespace fsdp_ckpt {

using nlohmann::json;
namespace st = fsdp::safetensors;

namespace {

constexpr uint64_t kDiffChunkBytes = 16 << 20;

struct DiffOptions {
  std::vector<std::string> ignore{"/rng_states", "/commit_index"};
  size_t max_diffs = 20;
  std::string a, b;
};

DiffOptions parse_diff_args(const Args& args) {
  DiffOptions o;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--ignore-world") {
      o.ignore.push_back("/world_size");
      o.ignore.push_back("/strategy");
    } else if (a == "--ignore" || a == "--max-diffs") {
      if (i + 1 >= args.size()) throw UsageError("diff: " + a + " needs a value");
      const std::string v = args[++i];
      if (a == "--ignore") {
        if (v.empty() || v[0] != '/')
          throw UsageError("diff: --ignore takes a JSON pointer such as /extra/config/fsdp, got '" + v + "'");
        o.ignore.push_back(v);
      } else {
        char* end = nullptr;
        const long n = std::strtol(v.c_str(), &end, 10);
        if (v.empty() || *end != '\0' || n < 1)
          throw UsageError("diff: --max-diffs expects a positive integer, got '" + v + "'");
        o.max_diffs = static_cast<size_t>(n);
      }
    } else if (!a.empty() && a[0] == '-') {
      throw UsageError("diff: unknown option " + a);
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2) throw UsageError("diff takes two checkpoint directories, A and B");
  o.a = positional[0];
  o.b = positional[1];
  return o;
}

// Counts differences and prints the first max_shown of each section (the file sets, each file set,
// train_state.json) as they come, so one section's flood cannot hide another's.
struct Differences {
  explicit Differences(size_t max) : max_shown(max) {}

  size_t max_shown;
  size_t count = 0;
  std::string section;
  size_t in_section = 0;

  void begin(const std::string& name) {
    end();
    section = name;
    in_section = 0;
  }
  void end() {
    if (in_section > max_shown)
      std::printf("... and %zu more differences in %s\n", in_section - max_shown, section.c_str());
    in_section = 0;
  }
  void add(const std::string& what) {
    ++count;
    if (in_section++ < max_shown) std::printf("%s\n", what.c_str());
  }
};

bool ignored(const std::string& pointer, const std::vector<std::string>& ignore) {
  for (const auto& p : ignore) {
    if (pointer == p ||
        (pointer.size() > p.size() && pointer.compare(0, p.size(), p) == 0 && pointer[p.size()] == '/')) {
      return true;
    }
  }
  return false;
}

std::string short_dump(const json& j) {
  std::string s = j.dump();
  return s.size() > 120 ? s.substr(0, 117) + "..." : s;
}

void diff_train_state(const json& a, const json& b, const DiffOptions& o, Differences& d) {
  // json::diff gives the edits that turn a into b, one per differing leaf (or whole subtree), in
  // key order; shallow fields (step, samples_seen) go first so that a flood of per-tensor optimizer
  // steps cannot push them out of sight.
  const json patch = json::diff(a, b);
  std::vector<json> ops(patch.begin(), patch.end());
  auto depth = [](const json& op) {
    const std::string p = op["path"].get<std::string>();
    return std::count(p.begin(), p.end(), '/');
  };
  std::stable_sort(ops.begin(), ops.end(), [&](const json& x, const json& y) { return depth(x) < depth(y); });
  for (const auto& op : ops) {
    const std::string path = op["path"].get<std::string>();
    if (ignored(path, o.ignore)) continue;
    const std::string kind = op["op"].get<std::string>();
    const json::json_pointer ptr(path);
    if (kind == "replace") {
      d.add("train_state.json " + path + ": " + short_dump(a.at(ptr)) + " vs " + short_dump(b.at(ptr)));
    } else if (kind == "remove") {
      d.add("train_state.json " + path + ": only in A (" + short_dump(a.at(ptr)) + ")");
    } else {
      d.add("train_state.json " + path + ": only in B (" + short_dump(op.value("value", json())) + ")");
    }
  }
}

// Compares two tensors' data (same dtype and shape) in chunks, so memory stays bounded for any
// tensor size; an empty result means byte-identical.
std::string diff_data(const Checkpoint& ca, const TensorLocation& ta, const Checkpoint& cb, const TensorLocation& tb) {
  const uint64_t item = st::itemsize(ta.entry.dtype);
  const uint64_t total = ta.entry.nbytes();
  const uint64_t chunk = (kDiffChunkBytes / item) * item;
  const auto type = st::to_scalar_type(ta.entry.dtype);
  std::string bytes_a, bytes_b;
  double max_abs = 0;
  int64_t differing = 0;
  for (uint64_t off = 0; off < total; off += chunk) {
    const uint64_t n = std::min(chunk, total - off);
    read_bytes(ca.dir, ta.file, ta.offset + off, n, bytes_a);
    read_bytes(cb.dir, tb.file, tb.offset + off, n, bytes_b);
    if (bytes_a == bytes_b) continue;
    auto as_double = [&](std::string& bytes) {
      return at::from_blob(bytes.data(), {static_cast<int64_t>(n / item)}, at::TensorOptions().dtype(type))
          .to(at::kDouble);
    };
    const at::Tensor x = as_double(bytes_a), y = as_double(bytes_b);
    max_abs = std::max(max_abs, (x - y).abs().nan_to_num(0).max().item<double>());
    // Elements whose bytes differ: unequal values, plus equal values with other bits (0.0 / -0.0,
    // NaN payloads), so the count is never 0 when the bytes differ.
    const auto elems = static_cast<int64_t>(n / item);
    for (int64_t i = 0; i < elems; ++i) {
      differing += std::memcmp(bytes_a.data() + i * item, bytes_b.data() + i * item, item) != 0;
    }
  }
  if (differing == 0) return "";
  char buf[160];
  std::snprintf(buf, sizeof buf, "max abs diff %.6g (%" PRId64 " of %" PRId64 " elements differ)", max_abs, differing,
                static_cast<int64_t>(total / item));
  return buf;
}

void diff_file_set(const Checkpoint& ca, const FileSet& a, const Checkpoint& cb, const FileSet& b, Differences& d) {
  for (const auto& name : a.order) {
    if (!b.tensors.count(name)) d.add(a.kind + ": tensor '" + name + "' only in A");
  }
  for (const auto& name : b.order) {
    if (!a.tensors.count(name)) d.add(b.kind + ": tensor '" + name + "' only in B");
  }
  for (const auto& name : a.order) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) continue;
    const auto& ta = a.tensors.at(name);
    const auto& tb = it->second;
    if (ta.entry.dtype != tb.entry.dtype || ta.entry.shape != tb.entry.shape) {
      d.add(a.kind + ": tensor '" + name + "': " + st::dtype_name(ta.entry.dtype) + " " + shape_text(ta.entry.shape) +
            " vs " + st::dtype_name(tb.entry.dtype) + " " + shape_text(tb.entry.shape));
      continue;
    }
    const std::string what = diff_data(ca, ta, cb, tb);
    if (!what.empty()) d.add(a.kind + ": tensor '" + name + "': " + what);
  }
}

}  // namespace

int run_diff(const Args& args) {
  const DiffOptions o = parse_diff_args(args);
  const Checkpoint a = open_checkpoint(o.a);
  const Checkpoint b = open_checkpoint(o.b);
  std::printf("A: %s\nB: %s\n", a.dir.c_str(), b.dir.c_str());
  Differences d(o.max_diffs);
  d.begin("the file sets");
  for (const auto& set : a.sets) {
    if (b.find(set.kind) == nullptr) d.add("file set " + set.kind + " only in A");
  }
  for (const auto& set : b.sets) {
    if (a.find(set.kind) == nullptr) d.add("file set " + set.kind + " only in B");
  }
  uint64_t compared = 0;
  for (const auto& set : a.sets) {
    if (const FileSet* other = b.find(set.kind)) {
      d.begin(set.kind);
      diff_file_set(a, set, b, *other, d);
      compared += set.tensors.size();
    }
  }
  d.begin("train_state.json");
  diff_train_state(a.state, b.state, o, d);
  d.end();
  if (d.count == 0) {
    std::printf("identical: %" PRIu64 " tensors in %zu file sets, and train_state.json (ignoring", compared,
                a.sets.size());
    for (const auto& p : o.ignore) std::printf(" %s", p.c_str());
    std::printf(")\n");
    return 0;
  }
  std::printf("different: %zu differences\n", d.count);
  return 1;
}

}  // namespace fsdp_ckpt
