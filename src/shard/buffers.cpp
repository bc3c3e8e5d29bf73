// Buffers of a sharded model (FullyShardOptions::buffers): which are persistent, their cast by
// MixedPrecisionPolicy::buffer_dtype, the check that every rank holds the same ones, and their
// synchronisation across ranks (BufferSync). Buffers are small and replicated: they are never
// sharded, and every collective here runs over the whole job.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>

#include <map>
#include <set>
#include <unordered_set>

#include "fsdp/errors.h"
#include "flat/param_data.h"
#include "shard/sharded_unit.h"

namespace fsdp {
namespace {

struct Found {
  std::string name;
  at::Tensor tensor;
  ShardedUnit* owner;  // the innermost unit whose module holds it
};

void collect(const torch::nn::Module& module, const std::string& prefix, ShardedUnit* owner, std::vector<Found>& out,
             std::unordered_set<const void*>& seen) {
  if (ShardedUnit* unit = detail::unit_of(module)) owner = unit;
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (!b.value().defined() || !seen.insert(b.value().unsafeGetTensorImpl()).second) continue;
    out.push_back({prefix + b.key(), b.value(), owner});
  }
  for (const auto& child : module.named_children())
    collect(*child.value(), prefix + child.key() + ".", owner, out, seen);
}

// Slots per buffer in the cross-rank check: dtype, ndim, the first kDims sizes, a hash of all.
constexpr int kDims = 6;
constexpr int kSlots = kDims + 3;

std::vector<double> signature(const at::Tensor& t) {
  std::vector<double> s(kSlots, -1);
  s[0] = static_cast<double>(t.scalar_type());
  s[1] = static_cast<double>(t.dim());
  uint64_t h = 1469598103934665603ULL;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d < kDims) s[2 + d] = static_cast<double>(t.size(d));
    h = (h ^ static_cast<uint64_t>(t.size(d))) * 1099511628211ULL;
  }
  s[kSlots - 1] = static_cast<double>(h % (1ULL << 50));
  return s;
}

std::string describe(const double* s) {
  const auto dtype = static_cast<at::ScalarType>(static_cast<int>(s[0]));
  std::string shape = "[";
  for (int d = 0; d < static_cast<int>(s[1]); ++d) {
    shape += (d ? ", " : "") + (d < kDims ? std::to_string(static_cast<int64_t>(s[2 + d])) : std::string("..."));
  }
  return "shape " + shape + "] " + c10::toString(dtype);
}

// Every rank holds the same persistent buffers (count, then each one's dtype and shape), or every
// rank throws the same error naming the first buffer that differs and the ranks.
void check_same_on_every_rank(Communicator& world, const std::vector<BufferState>& buffers) {
  const int n = world.size();
  auto mine = at::full({1}, static_cast<double>(buffers.size()), at::kDouble);
  auto counts = at::empty({n}, at::kDouble);
  world.all_gather(counts, mine, "buffers/check").wait();
  for (int r = 1; r < n; ++r) {
    if (counts[r].item<double>() != counts[0].item<double>()) {
      throw ConfigError("fsdp: ranks hold different persistent buffers: rank 0 has " +
                        std::to_string(counts[0].item<int64_t>()) + ", rank " + std::to_string(r) + " has " +
                        std::to_string(counts[r].item<int64_t>()) +
                        "; every rank must build the same model (or declare the extra ones non-persistent)");
    }
  }
  if (buffers.empty()) return;
  std::vector<double> sig;
  for (const auto& b : buffers) {
    const auto s = signature(b.tensor);
    sig.insert(sig.end(), s.begin(), s.end());
  }
  const int64_t per_rank = static_cast<int64_t>(sig.size());
  auto local = at::tensor(sig, at::kDouble);
  auto all = at::empty({n * per_rank}, at::kDouble);
  world.all_gather(all, local, "buffers/check").wait();
  const double* a = all.data_ptr<double>();
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (int r = 1; r < n; ++r) {
      const double* s0 = a + i * kSlots;
      const double* sr = a + r * per_rank + i * kSlots;
      if (std::equal(s0, s0 + kSlots, sr)) continue;
      throw ConfigError("fsdp: buffer '" + buffers[i].name + "' differs across ranks: " + describe(s0) +
                        " on rank 0 but " + describe(sr) + " on rank " + std::to_string(r) +
                        "; buffers are replicated, so every rank must hold it with the same shape and dtype");
    }
  }
}

// Broadcasts every buffer from rank 0 (average: floating ones averaged over the ranks instead),
// one collective per (dtype, device): buffers are many and small.
void exchange(Communicator& world, std::vector<BufferState>& buffers, bool average) {
  c10::NoGradGuard no_grad;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> by_kind;
  for (auto& b : buffers) {
    by_kind[{static_cast<int>(b.tensor.scalar_type()), b.tensor.device().str()}].push_back(b.tensor);
  }
  for (auto& [kind, tensors] : by_kind) {
    std::vector<at::Tensor> flat;
    for (auto& t : tensors) flat.push_back(t.detach().reshape({-1}));
    at::Tensor joined = at::cat(flat);
    if (average && joined.is_floating_point()) {
      world.all_reduce(joined, ReduceOp::kAvg, "buffers").wait();
    } else {
      world.broadcast(joined, 0, "buffers").wait();
    }
    // Written below the in-place/version-counter layer: a forward that saved a buffer for a
    // backward still to come (two forwards, one backward) must not see its version move. The
    // values such a backward could read change only for buffers the forward itself updated
    // (running statistics), which backward in training mode does not read.
    at::AutoDispatchBelowADInplaceOrView below_version_counter;
    int64_t at_elem = 0;
    for (auto& t : tensors) {
      t.detach().copy_(joined.narrow(0, at_elem, t.numel()).view(t.sizes()));
      at_elem += t.numel();
    }
  }
}

// A buffer built on the meta device (fsdp/meta.h) is materialised whole, on every rank, by its
// unit's deferred init under its name relative to the root, in its own dtype.
void materialize_buffer(const Found& f, const ParamInitFn& init, c10::Device device) {
  if (!init) {
    throw ConfigError("fsdp: buffer '" + f.name +
                      "' is on the meta device and its unit has no FullyShardOptions::init to materialise it: pass "
                      "an init function that covers buffers too (fsdp/init.h, e.g. init::by_suffix({{\"running_var\", "
                      "init::constant(1)}, {\"running_mean\", init::constant(0)}}, ...)), or load a checkpoint");
  }
  materialize_whole(f.tensor, f.name, init, device);
}

}  // namespace

void ShardedUnit::init_buffers() {
  RootState& rs = *root_state_;
  auto module = module_.lock();
  std::vector<Found> found;
  std::unordered_set<const void*> seen;
  collect(*module, "", this, found, seen);
  const BufferPolicy& policy = requested_.buffers();
  rs.buffer_sync = policy.sync();
  std::set<std::string> skip;
  for (const auto& name : policy.non_persistent()) {
    const bool exists = std::any_of(found.begin(), found.end(), [&](const Found& f) { return f.name == name; });
    if (!exists) {
      std::string names;
      for (const auto& f : found) names += (names.empty() ? "" : ", ") + f.name;
      throw ConfigError("fsdp: BufferPolicy::non_persistent names '" + name + "', which is not a buffer of the root (" +
                        (names.empty() ? std::string("it has none") : "its buffers: " + names) + ")");
    }
    skip.insert(name);
  }
  rs.buffers.clear();
  c10::NoGradGuard no_grad;
  for (auto& f : found) {
    if (f.tensor.is_meta())
      materialize_buffer(f, f.owner->options_.init, f.owner->flat_params_.front()->config().device);
    if (skip.count(f.name)) continue;
    const void* key = f.tensor.unsafeGetTensorImpl();
    auto& dtypes = f.owner->buffer_dtypes_;
    if (!dtypes.count(key)) dtypes[key] = f.tensor.scalar_type();
    const auto& cast = f.owner->options_.mp_policy.buffer_dtype();
    if (cast && f.tensor.is_floating_point() && f.tensor.scalar_type() != *cast) {
      rebind_param_data(f.tensor, f.tensor.detach().to(*cast));
    }
    rs.buffers.push_back({f.name, f.tensor, dtypes[key]});
  }
  Communicator& world = mesh_.dist().world();
  if (world.size() == 1) return;
  check_same_on_every_rank(world, rs.buffers);
  // Start from one value everywhere, as DDP does at construction.
  if (rs.buffer_sync != BufferSync::kLocal) exchange(world, rs.buffers, /*average=*/false);
}

void ShardedUnit::sync_buffers() {
  RootState& rs = root_state();
  Communicator& world = mesh_.dist().world();
  rs.buffers_dirty = false;
  if (rs.buffers.empty() || rs.buffer_sync == BufferSync::kLocal || world.size() == 1) return;
  exchange(world, rs.buffers, rs.buffer_sync == BufferSync::kAverage);
}

}  // namespace fsdp
