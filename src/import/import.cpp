// import_weights (include/fsdp/checkpoint.h, Note [Importing weights]): a foreign safetensors file
// set read into the fp32 master shards. The layout is the checkpoint's (checkpoint/layout.h), so
// each rank knows its byte ranges exactly as load does; what differs from load is that the files
// are not ours: a single model.safetensors without an index is accepted, tensors come in BF16, F16
// or F32 and are converted on the way, tied parameters may be stored under either name, and there
// is no train_state.json. A tensor named in ImportOptions::grow_rows may have fewer rows in the
// source; the added ones get the mean of the source's (Note [Grown rows]). import_unsharded runs
// the same checks and conversion into an ordinary module.
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "base/file_io.h"
#include "base/strings.h"
#include "bnb/bnb4.h"
#include "checkpoint/layout.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "safetensors/file_set.h"
#include "safetensors/safetensors.h"
#include "safetensors/torch_dtypes.h"
#include "shard/checkpoint_view.h"

namespace fsdp::checkpoint {

using namespace io;  // NOLINT: file helpers read as plain calls here

namespace {

namespace st = safetensors;
using base::shape_text;

// Elements converted at a time: bounds the staging buffer (16 MiB of F32, 8 MiB of BF16).
constexpr int64_t kChunkElements = 4 << 20;
constexpr size_t kMaxProblems = 12;

struct Source : st::FileSet {
  std::string dir;
};

// model.safetensors.index.json and its files, or a lone model.safetensors.
Source open_source(const std::string& dir, const std::string& file) {
  if (!is_dir(dir)) throw CheckpointError("fsdp: import: " + dir + " is not a directory");
  std::optional<st::FileSet> read =
      st::read_index_or_file(dir, file, "fsdp: import: " + join(dir, file + ".index.json"));
  if (!read) {
    throw CheckpointError("fsdp: import: " + dir + " has neither " + file + " nor " + file +
                          ".index.json; the weights of a Hugging Face model directory are one of the two");
  }
  Source src;
  static_cast<st::FileSet&>(src) = std::move(*read);
  src.dir = dir;
  return src;
}

// Where each of the model's tensors is in the source.
struct Located {
  std::string file;
  const st::TensorEntry* entry = nullptr;
  bool grown = false;                         // the source has fewer rows than the model (Note [Grown rows])
  std::shared_ptr<bnb::Reader4> q = nullptr;  // a bitsandbytes 4-bit weight (Note [bitsandbytes 4-bit weights])
};

bool may_grow(const ShardedTensorView& t, const std::set<std::string>& grow_rows) {
  if (grow_rows.count(t.name)) return true;
  for (const auto& a : t.aliases) {
    if (grow_rows.count(a)) return true;
  }
  return false;
}

// The source's shape against the model's: "" when it fits (grown: fewer rows, the rest equal),
// else the problem.
std::string shape_problem(const st::TensorEntry& e, const ShardedTensorView& t, bool growable, bool& grown) {
  grown = false;
  if (e.shape == t.shape) return "";
  const bool same_rank = e.shape.size() == t.shape.size() && !e.shape.empty();
  const bool same_rows = same_rank && std::equal(e.shape.begin() + 1, e.shape.end(), t.shape.begin() + 1);
  if (growable && same_rows && e.shape[0] > 0 && e.shape[0] < t.shape[0]) {
    grown = true;
    return "";
  }
  std::string why =
      "tensor '" + e.name + "' has shape " + shape_text(e.shape) + " but the model's has shape " + shape_text(t.shape);
  if (growable && same_rows && e.shape[0] > t.shape[0]) {
    why += ": its rows can grow (a larger vocabulary), not shrink";
  }
  return why;
}

void add_problem(std::vector<std::string>& problems, const std::string& p) {
  if (problems.size() < kMaxProblems) problems.push_back(p);
}

// Every check of Note [Importing weights], every problem reported at once (up to kMaxProblems).
std::vector<Located> locate(const Source& src, const std::vector<ShardedTensorView>& tensors,
                            const std::set<std::string>& grow_rows, const std::string& prefix) {
  std::vector<Located> out(tensors.size());
  std::vector<std::string> problems;
  std::set<std::string> claimed;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    std::vector<std::string> names = {prefix + t.name};
    for (const auto& a : t.aliases) names.push_back(prefix + a);
    for (const auto& n : names) {
      auto it = src.index.weight_map.find(n);
      if (it == src.index.weight_map.end()) continue;
      claimed.insert(n);
      if (out[i].entry == nullptr) out[i] = {it->second, src.headers.at(it->second).find(n)};
    }
    if (out[i].entry == nullptr) {
      add_problem(problems, "missing tensor '" + t.name + "' (shape " + shape_text(t.shape) + ")" +
                                (t.aliases.empty() ? "" : ", nor any of its tied names"));
      continue;
    }
    const auto& e = *out[i].entry;
    std::string problem;
    out[i].q = bnb::find_weight4(src, src.dir, e.name, t.shape, problem, claimed);
    if (!problem.empty()) add_problem(problems, out[i].file + ": " + problem);
    if (out[i].q || !problem.empty()) continue;
    if (e.dtype != st::DType::BF16 && e.dtype != st::DType::F16 && e.dtype != st::DType::F32) {
      add_problem(problems, out[i].file + ": tensor '" + t.name + "' is " + st::dtype_name(e.dtype) +
                                "; import reads BF16, F16 and F32");
    }
    const std::string shape = shape_problem(e, t, may_grow(t, grow_rows), out[i].grown);
    if (!shape.empty()) add_problem(problems, out[i].file + ": " + shape);
  }
  for (const auto& [name, file] : src.index.weight_map) {
    if (!claimed.count(name))
      add_problem(problems, file + ": unexpected tensor '" + name + "' the model does not have");
  }
  if (!problems.empty()) {
    std::string msg = "fsdp: import: " + src.dir + " does not match the model:";
    for (const auto& p : problems) msg += "\n  " + p;
    if (problems.size() == kMaxProblems) msg += "\n  (further problems not listed)";
    throw CheckpointError(msg);
  }
  return out;
}

using ValuesWritten = std::function<void(int64_t begin, const at::Tensor& values)>;
using StoreCodes = std::function<bool(int64_t begin, int64_t count, const std::function<at::Tensor()>& absmax,
                                      std::shared_ptr<const File> file, int64_t offset)>;

// Reads elements [begin, begin + count) of the tensor at `loc` into dst[shard_begin, ...),
// converting to dst's dtype through `staging` (the source dtype) in chunks; `written` (if set)
// sees each chunk's fp32 values where they were written (FlatShardView::values_written). With
// `store` (FlatShardView::store_values) each chunk is stored as read instead, dst left alone. A
// bitsandbytes 4-bit weight is read by its reader: its NF4 stored form where a store takes whole
// blocks, else its values (bnb/bnb4.h); with `store_codes`, whole blocks take their codes in place
// from `file` where the stored form can (FlatShardView::store_codes), their absmax from the reader.
uint64_t read_converted(const std::shared_ptr<const File>& file, const st::Header& header, const Located& loc,
                        int64_t begin, int64_t count, const ShardTensor& shard, int64_t shard_begin,
                        at::Tensor& staging, const ValuesWritten& written = nullptr,
                        const ValuesWritten& store = nullptr, const StoreCodes& store_codes = nullptr) {
  const at::Tensor& dst = shard.values();
  const auto item = static_cast<int64_t>(st::itemsize(loc.entry->dtype));
  const uint64_t base = header.data_start() + loc.entry->begin;
  const bool f32 = loc.entry->dtype == st::DType::F32 && !loc.q;
  // Straight into the state's memory when it is fp32 RAM; a disk-tier master gets host chunks its
  // tier writes (ShardTensor::Writer), so its mapping is not paged through.
  const bool in_file = shard.in_file();
  const bool direct = f32 && dst.is_cpu() && dst.scalar_type() == at::kFloat && !in_file && !store;
  const bool blocks = store && begin % bnb::kBlock == 0 && shard_begin % bnb::kBlock == 0 && count % bnb::kBlock == 0;
  const uint64_t q_before = loc.q ? loc.q->bytes_read() : 0;
  ShardTensor::Writer out(shard, "import of " + loc.entry->name);
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(kChunkElements, count - done);
    const uint64_t at_byte = base + static_cast<uint64_t>((begin + done) * item);
    const int64_t at_elem = shard_begin + done;
    if (loc.q && blocks && store_codes &&
        store_codes(
            at_elem, n, [&] { return loc.q->absmax((begin + done) / bnb::kBlock, n / bnb::kBlock); }, file,
            static_cast<int64_t>(base) + (begin + done) / 2)) {
      done += n;
      continue;
    }
    if (direct) {
      file->pread_all(dst.data_ptr<float>() + at_elem, n * item, at_byte);
      if (written) written(at_elem, dst.narrow(0, at_elem, n));
    } else {
      const auto type = st::to_scalar_type(loc.entry->dtype);
      if (!staging.defined() || staging.scalar_type() != type) staging = at::empty({kChunkElements}, type);
      if (!loc.q) file->pread_all(staging.data_ptr(), n * item, at_byte);
      const at::Tensor part = loc.q ? loc.q->chunk(begin + done, n, blocks) : staging.narrow(0, 0, n);
      if (store) {
        store(at_elem, part);
      } else if (in_file) {
        out.make_room();
        const at::Tensor values = part.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
        if (written) written(at_elem, values);
        out.put(at_elem, values);
      } else {
        dst.narrow(0, at_elem, n).copy_(part);
        if (written && dst.is_cpu()) written(at_elem, dst.narrow(0, at_elem, n));
      }
    }
    done += n;
  }
  out.finish();
  shard.done(shard_begin, shard_begin + count);  // a disk tier: now on disk
  return loc.q ? loc.q->bytes_read() - q_before : static_cast<uint64_t>(count * item);
}

int64_t source_numel(const Located& l) {
  if (l.q) return l.q->numel();
  int64_t n = 1;
  for (const int64_t d : l.entry->shape) n *= d;
  return n;
}

// Reads every located tensor into its flat param's master; `flat_done(f)` as soon as the last
// tensor of flat param f is read, unless one of its tensors grows (fill_grown writes it later).
// A frozen master kept in a stored form is then stored at once, so that the fp32 copy the import
// writes into is alive for a few flat params at a time, not the whole model.
uint64_t read_all(const Source& src, const CheckpointLayout& layout, const std::vector<Located>& located,
                  bool codes_in_place, const std::function<void(size_t flat)>& flat_done) {
  std::vector<int64_t> left(layout.flats.size(), 0);
  std::vector<bool> grows(layout.flats.size(), false);  // fill_grown reads its values back: not stored as read
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    left[layout.tensors[i].flat] += located[i].grown ? (int64_t{1} << 40) : 1;  // a grown one never finishes here
    grows[layout.tensors[i].flat] = grows[layout.tensors[i].flat] || located[i].grown;
  }
  std::map<std::string, std::shared_ptr<const File>> files;
  at::Tensor staging;
  uint64_t bytes = 0;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const auto& t = layout.tensors[i];
    const bool last = --left[t.flat] == 0;
    auto span = shard_span(layout.flats[t.flat].shard, t);
    if (!span) {
      if (last) flat_done(t.flat);
      continue;
    }
    // A grown tensor's source rows are its first elements; the rest are filled by fill_grown.
    span->count = std::min(span->count, source_numel(located[i]) - span->tensor_begin);
    if (span->count <= 0) continue;
    const FlatShardView& flat = layout.flats[t.flat].shard;
    auto it = files.find(located[i].file);
    if (it == files.end())
      it =
          files.emplace(located[i].file, std::make_shared<File>(File::open_read(join(src.dir, located[i].file)))).first;
    bytes += read_converted(it->second, src.headers.at(located[i].file), located[i], span->tensor_begin, span->count,
                            flat.master, span->shard_begin, staging, flat.values_written,
                            grows[t.flat] ? nullptr : flat.store_values,
                            grows[t.flat] || !codes_in_place ? nullptr : flat.store_codes);
    if (last) flat_done(t.flat);
  }
  return bytes;
}

// Calls fn(off, n, col) over elements [0, count) of a span that starts at element `begin` of a
// tensor with rows of `row` elements, in pieces that lie within one row (col + n <= row) or are
// whole rows (col 0, n a multiple of row, at most about kChunkElements).
void for_row_pieces(int64_t begin, int64_t count, int64_t row,
                    const std::function<void(int64_t off, int64_t n, int64_t col)>& fn) {
  for (int64_t off = 0; off < count;) {
    const int64_t col = (begin + off) % row;
    int64_t n = std::min(row - col, count - off);
    if (col == 0 && count - off >= row)
      n = std::min((count - off) / row, std::max<int64_t>(1, kChunkElements / row)) * row;
    fn(off, n, col);
    off += n;
  }
}

// Adds the span's elements of `shard` to `sums` (fp64 on the CPU, one per column).
void add_column_sums(const at::Tensor& shard, const Span& span, int64_t row, at::Tensor& sums) {
  for_row_pieces(span.tensor_begin, span.count, row, [&](int64_t off, int64_t n, int64_t col) {
    const at::Tensor part = shard.narrow(0, span.shard_begin + off, n).to(at::kCPU, at::kDouble);
    if (col + n <= row) {
      sums.narrow(0, col, n).add_(part);
    } else {
      sums.add_(part.view({n / row, row}).sum(0));
    }
  });
}

// Writes mean[col] to every element of the span.
void fill_rows(const ShardTensor& master, const Span& span, int64_t row, const at::Tensor& mean) {
  const at::Tensor& shard = master.values();
  for_row_pieces(span.tensor_begin, span.count, row, [&](int64_t off, int64_t n, int64_t col) {
    at::Tensor out = shard.narrow(0, span.shard_begin + off, n);
    if (col + n <= row) {
      out.copy_(mean.narrow(0, col, n));
    } else {
      out.view({n / row, row}).copy_(mean.unsqueeze(0).expand({n / row, row}));
    }
  });
  master.done(span.shard_begin, span.shard_begin + span.count);
}

// Note [Grown rows]: the added rows of tensor t, whose first src_rows rows are already read, are
// the mean of those. Collective: one all-reduce, which every rank joins.
void fill_grown(const CheckpointLayout& layout, const ShardedTensorView& t, int64_t src_rows, Dist& dist) {
  const int64_t row = t.numel / t.shape[0];
  const int64_t src_numel = src_rows * row;
  const FlatShardView& flat = layout.flats[t.flat].shard;
  const auto span = shard_span(flat, t);
  at::Tensor sums = at::zeros({row}, at::kDouble);
  // Replicas of a shard (HSDP, NO_SHARD) hold the same elements: only the writer's count.
  if (span && flat.writer && span->tensor_begin < src_numel) {
    Span old = *span;
    old.count = std::min(old.count, src_numel - old.tensor_begin);
    add_column_sums(flat.master.values(), old, row, sums);
  }
  dist.side_group("checkpoint").all_reduce(sums, ReduceOp::kSum, "checkpoint/import_grown_rows").wait();
  if (!span || span->tensor_begin + span->count <= src_numel) return;
  const int64_t skip = std::max<int64_t>(0, src_numel - span->tensor_begin);
  Span added = *span;
  added.tensor_begin += skip;
  added.shard_begin += skip;
  added.count -= skip;
  const at::Tensor mean = (sums / static_cast<double>(src_rows)).to(flat.master.values().device(), at::kFloat);
  fill_rows(flat.master, added, row, mean);
}

// Every rank learns whether any rank failed; the failing ranks rethrow their own error.
void agree(Dist& dist, const std::string& dir, const std::string& local_error) {
  auto flags = at::zeros({dist.world_size()}, at::kFloat);
  if (!local_error.empty()) flags[dist.rank()] = 1;
  dist.side_group("checkpoint").all_reduce(flags, ReduceOp::kSum, "checkpoint/import").wait();
  if (!local_error.empty()) throw CheckpointError(local_error);
  for (int r = 0; r < dist.world_size(); ++r) {
    if (flags[r].item<float>() != 0) {
      throw CheckpointError("fsdp: import: reading " + dir + " failed on rank " + std::to_string(r) +
                            " (its error names the file); the model was not imported");
    }
  }
}

ImportReport report_of(const Source& src, const std::vector<Located>& located) {
  ImportReport report;
  report.files = src.index.files();
  report.tensors = static_cast<int64_t>(located.size());
  std::set<std::string> dtypes;
  for (const auto& l : located) {
    report.total_bytes += l.entry->nbytes();
    dtypes.insert(l.q ? "NF4 (bitsandbytes)" : st::dtype_name(l.entry->dtype));
  }
  for (const auto& d : dtypes) report.dtypes += (report.dtypes.empty() ? "" : ", ") + d;
  return report;
}

// ImportOptions::select: the tensors imported; the flat params they touch (`touched`), whose
// masters are written, after a stored frozen one that is only partly imported gets its values.
CheckpointLayout selected(const ModelView& model, const ImportOptions& options, std::vector<bool>& touched) {
  CheckpointLayout layout = make_layout(model, nullptr);
  std::vector<ShardedTensorView> kept;
  std::vector<bool> skipped(layout.flats.size(), false);
  for (auto& t : layout.tensors) {
    const bool take = !options.select() || options.select()(t.name);
    (take ? touched : skipped)[t.flat] = true;
    if (take) kept.push_back(std::move(t));
  }
  layout.tensors = std::move(kept);
  for (size_t f = 0; f < layout.flats.size(); ++f) {
    auto& shard = layout.flats[f].shard;
    if (!touched[f] || !skipped[f]) continue;
    // Partly imported: the rest keeps its values, so the imported ones go through the fp32 copy.
    if (shard.read_values) shard.read_values();
    shard.store_values = nullptr;
  }
  return layout;
}

// Whatever ends an import, no flat param is left waiting for its values (finish_deferred_init: a
// no-op once the import wrote them all).
struct DeferredInitGuard {
  FSDPModule& root;
  ~DeferredInitGuard() {
    try {
      finish_deferred_init(root);
    } catch (...) {  // NOLINT(bugprone-empty-catch): an init error stays for the next use to report
    }
  }
};

}  // namespace

ImportReport import_weights(const std::string& dir, FSDPModule& root, const ImportOptions& options) {
  // Every selected tensor is written whole, or the import throws: a lazy init it triggers leaves
  // those flat params to it (Note [Deferred init leaves what a load writes]).
  const auto& select = options.select();
  const ModelView model =
      model_view(root, /*frozen_values=*/false, [&select](const std::string& name) { return !select || select(name); });
  DeferredInitGuard guard{root};
  std::vector<bool> touched(model.flats.size(), false);
  const CheckpointLayout layout = selected(model, options, touched);
  // Every rank opens and checks the same files, so a bad directory fails on every rank alike.
  const Source src = open_source(dir, options.file_name());
  const std::set<std::string> grow(options.grow_rows().begin(), options.grow_rows().end());
  const std::vector<Located> located = locate(src, layout.tensors, grow, options.source_prefix());
  ImportReport report = report_of(src, located);

  std::string error;
  c10::NoGradGuard no_grad;
  std::vector<bool> written(layout.flats.size(), false);
  try {
    report.bytes_read = read_all(src, layout, located, options.codes_in_place(), [&](size_t f) {
      if (layout.flats[f].shard.master_written) layout.flats[f].shard.master_written();
      written[f] = true;
    });
  } catch (const std::exception& e) {
    error = std::string("fsdp: import: ") + e.what();
  }
  agree(*model.dist, dir, error);
  for (size_t i = 0; i < located.size(); ++i) {
    if (!located[i].grown) continue;
    const auto& t = layout.tensors[i];
    fill_grown(layout, t, located[i].entry->shape[0], *model.dist);
    report.grown.push_back(t.name + ": " + std::to_string(located[i].entry->shape[0]) + " -> " +
                           std::to_string(t.shape[0]) + " rows");
  }
  // The masters were written in place: what derives from them (the working copy of a master
  // that follows its offloaded state, the disk tier's generation) is brought up to date.
  for (size_t f = 0; f < layout.flats.size(); ++f) {
    if (touched[f] && !written[f] && layout.flats[f].shard.master_written) layout.flats[f].shard.master_written();
  }
  return report;
}

ImportReport import_unsharded(const std::string& dir, torch::nn::Module& module) {
  // Each parameter once, its tied names as aliases, as the sharded layout has them.
  std::vector<ShardedTensorView> tensors;
  std::vector<at::Tensor> params;
  std::map<const void*, size_t> by_storage;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const auto [it, fresh] = by_storage.emplace(item.value().unsafeGetTensorImpl(), tensors.size());
    if (!fresh) {
      tensors[it->second].aliases.push_back(item.key());
      continue;
    }
    ShardedTensorView t;
    t.name = item.key();
    t.shape = item.value().sizes().vec();
    t.numel = item.value().numel();
    tensors.push_back(t);
    params.push_back(item.value());
  }
  const Source src = open_source(dir, "model.safetensors");
  const std::vector<Located> located = locate(src, tensors, {}, "");
  ImportReport report = report_of(src, located);
  std::map<std::string, std::shared_ptr<const File>> files;
  std::vector<at::Tensor> values;  // read whole before any parameter changes
  at::Tensor staging;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = files.find(located[i].file);
    if (it == files.end())
      it = files.emplace(located[i].file, std::make_shared<File>(File::open_read(join(dir, located[i].file)))).first;
    values.push_back(at::empty({tensors[i].numel}, at::kFloat));
    report.bytes_read += read_converted(it->second, src.headers.at(located[i].file), located[i], 0, tensors[i].numel,
                                        ShardTensor(values.back()), 0, staging);
  }
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i].view(params[i].sizes()));
  return report;
}

}  // namespace fsdp::checkpoint
