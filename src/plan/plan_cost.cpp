// One set of choices costed (Note [The planner's arithmetic] in plan_cost.h).
#include "plan/plan_cost.h"

#include <algorithm>

#include "base/direct_writer.h"
#include "offload/placement.h"
#include "frozen/frozen_storage.h"
#include "offload/tier_rules.h"
#include "fsdp/errors.h"
#include "prefetch/keep_params.h"
#include "shard/resolved_options.h"

namespace fsdp::planning {

int64_t add_bytes(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (b < 0 || __builtin_add_overflow(a, b, &r)) {
    throw ConfigError("fsdp::plan: " + what +
                      " overflows 64-bit bytes: the model shape or the request (seq_len, batch) is too large to plan");
  }
  return r;
}
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t elem(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

struct Sizes {
  int64_t root = 0, largest_param = 0;
  // The same for gradients: trainable elements only (a frozen base has none).
  int64_t root_trainable = 0, layer_max_trainable = 0, largest_trainable = 0;
  int64_t unit_max = 0, unit_max_trainable = 0;
  int64_t other_max_trainable = 0;    // the largest unit that is neither the root nor a layer (a head of its own)
  int64_t layer_max_frozen_part = 0;  // a layer's largest frozen part (one flat param of a storage)
  int64_t units = 0;
};

Sizes sizes_of(const ModelShape& shape) {
  Sizes s;
  const std::vector<bool> layer = layers_of(shape);
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const UnitShape& u = shape.units[i];
    if (u.is_root) {
      s.root += u.numel();
      s.root_trainable += u.trainable_numel;
    } else if (layer[i]) {
      s.layer_max_trainable = std::max(s.layer_max_trainable, u.trainable_numel);
      if (u.frozen_by_storage.empty()) s.layer_max_frozen_part = std::max(s.layer_max_frozen_part, u.frozen_numel);
      for (const auto& [storage, numel] : u.frozen_by_storage)
        s.layer_max_frozen_part = std::max(s.layer_max_frozen_part, numel);
    } else {
      s.other_max_trainable = std::max(s.other_max_trainable, u.trainable_numel);
    }
    const int64_t largest = u.largest_param_numel > 0 ? u.largest_param_numel : u.numel();
    s.largest_param = std::max(s.largest_param, largest);
    s.largest_trainable = std::max(s.largest_trainable, std::min(largest, u.trainable_numel));
    if (u.numel() > s.unit_max) {
      s.unit_max = u.numel();
      s.unit_max_trainable = u.trainable_numel;
    }
    ++s.units;
  }
  return s;
}

// The per-rank bytes of the sharded states, by tier, and the offload I/O per step.
struct States {
  offload::TierBytes tier;
  offload::TierBytes loaded;  // what the load leaves (Note [The load and the save])
  int64_t master = 0, working = 0, grads = 0, optimizer = 0;
  int64_t stored_largest = 0;   // the largest stored frozen shard's fp32 values (4 bytes each)
  bool master_on_disk = false;  // a master in the disk tier
  bool cast_working = false;    // a working copy in a dtype other than fp32
  offload::StepIo io;
};

// A unit's frozen elements by resolved storage (FrozenStorage::kParamDtype made concrete).
std::vector<std::pair<FrozenStorage, int64_t>> frozen_parts(const UnitShape& u, at::ScalarType param_dtype) {
  const FrozenStorage compute = param_dtype == at::kBFloat16 ? FrozenStorage::kBFloat16
                                : param_dtype == at::kHalf   ? FrozenStorage::kFloat16
                                                             : FrozenStorage::kFloat32;
  std::vector<std::pair<FrozenStorage, int64_t>> out;
  if (u.frozen_by_storage.empty()) {
    if (u.frozen_numel > 0) out.emplace_back(compute, u.frozen_numel);
    return out;
  }
  for (const auto& [storage, numel] : u.frozen_by_storage) {
    out.emplace_back(storage == FrozenStorage::kParamDtype ? compute : storage, numel);
  }
  return out;
}

// Bytes per rank of a frozen part as stored (Note [Frozen storage]).
int64_t stored_bytes(FrozenStorage s, int64_t numel, int N) {
  return static_cast<int64_t>(static_cast<double>(ceil_div(numel, N)) * frozen::bytes_per_value(s));
}

// Bytes per rank of a unit's frozen shards as stored.
int64_t frozen_bytes(const UnitShape& u, at::ScalarType param_dtype, int N) {
  int64_t bytes = 0;
  for (const auto& [storage, numel] : frozen_parts(u, param_dtype)) bytes += stored_bytes(storage, numel, N);
  return bytes;
}

bool replicated_trainable(const UnitShape& u, const PlanRequest& req) {
  return req.replicate_adapters && u.trainable_numel > 0 && u.frozen_numel > 0;
}

// Elements of a unit that a gather makes anew in the compute dtype: replicated adapters computed in
// fp32 from a master in no tier are their master (a one-rank group's flat param aliases it).
int64_t gathered_numel(const UnitShape& u, const PlanRequest& req, const Choices& c) {
  if (u.vocab_parallel) return 0;
  const bool aliased = replicated_trainable(u, req) && req.param_dtype == at::kFloat && c.params == OffloadTier::kNone;
  return aliased ? u.frozen_numel : u.numel();
}

// Whether each unit runs backward: the root, a unit that trains, and every unit after one that
// does (its input requires grad). A frozen embedding in front of the layers does not, and the
// backward's prefetch passes it by (prefetch::Units::backward_done).
std::vector<bool> runs_backward(const ModelShape& shape) {
  std::vector<bool> out(shape.units.size());
  bool trained_before = false;
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const UnitShape& u = shape.units[i];
    out[i] = !u.vocab_parallel && (u.is_root || u.trainable_numel > 0 || trained_before);
    if (!u.is_root) trained_before = trained_before || u.trainable_numel > 0;
  }
  return out;
}

// What a unit holds between its forward and its backward, by the runtime's rules: its options
// resolved as fully_shard resolves them (resolve_reshard_after_forward, with
// PlanRequest::reshard_after_forward_group given to every unit but the root), then
// prefetch::keeps_params_after_forward (Note [The last unit keeps its params]; the last unit's
// forward taken to run with gradients on): its params gathered whole, nothing, or its part for a
// group (the group size). Kept across micro-batches (Choices::keep_gathered) is decided apart.
struct AfterForward {
  bool keeps = false;
  int group = 0;
};
AfterForward after_forward(const UnitShape& u, bool last, const PlanRequest& req, const Choices& c, int N) {
  ResolvedOptions o;
  const int k = u.is_root ? 0 : req.reshard_after_forward_group;
  resolve_reshard_after_forward(FullyShardOptions().strategy(c.strategy).reshard_after_forward_group(k), N, o,
                                "fsdp::plan");
  prefetch::ForwardEnd f;
  f.reshard_after_forward = o.reshard_after_forward;
  f.option_explicit = o.reshard_after_forward_explicit;
  f.is_root = u.is_root;
  f.ran_last = last;
  return {prefetch::keeps_params_after_forward(f), o.reshard_after_forward_group};
}

// Bytes of a unit's whole gathered buffers as they travel (the compute dtype, an int8 / NF4 frozen
// part in its stored form), replicated adapters aside: what its parts for a group add up to.
int64_t gathered_bytes(const UnitShape& u, const PlanRequest& req, int N) {
  const int64_t e = elem(req.param_dtype);
  int64_t bytes = replicated_trainable(u, req) ? 0 : e * ceil_div(u.trainable_numel, N) * N;
  for (const auto& [storage, numel] : frozen_parts(u, req.param_dtype)) {
    const bool decoded = storage == FrozenStorage::kInt8 || storage == FrozenStorage::kNF4 ||
                         (storage != FrozenStorage::kFloat32 && frozen::bytes_per_value(storage) != e);
    bytes += decoded ? stored_bytes(storage, numel, N) * N : e * ceil_div(numel, N) * N;
  }
  return bytes;
}

// Which units keep their forward read of a disk-tier master for backward: the runtime's rule
// (offload::units_keeping_forward_reads) over the units in forward order, theirs here.
std::vector<bool> forward_reads_kept(const ModelShape& shape, const Choices& c, const std::vector<int>& gathers,
                                     const std::vector<int64_t>& disk_bytes) {
  std::vector<offload::ForwardRead> reads;
  int64_t layer = 0;
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const UnitShape& u = shape.units[i];
    const bool checkpointed = c.checkpoint_every > 0 && u.checkpointable && layer % c.checkpoint_every == 0;
    if (u.checkpointable) ++layer;
    reads.push_back({&u, !checkpointed, gathers[i] == 2, disk_bytes[i]});
  }
  std::vector<bool> kept(shape.units.size(), false);
  for (const size_t i : offload::units_keeping_forward_reads(reads, c.disk_memory_budget)) kept[i] = true;
  return kept;
}

// One flat param placed, its bytes added to `s`; its step's I/O waits for the kept reads.
struct Placed {
  offload::StateTiers where;
  offload::FlatParamKind kind;
  offload::FlatParamIo f;
  size_t unit;
};

Placed place_flat(States& s, const PlanRequest& req, const OffloadPolicy& policy, bool stager, int N, size_t unit,
                  offload::FlatParamKind kind, int64_t shard_numel, int64_t master_bytes, int gathers) {
  const offload::StateTiers where = offload::place(policy, kind, stager);
  const int64_t e = elem(req.param_dtype);
  offload::FlatParamIo f;
  f.master_bytes = master_bytes;
  f.compute_bytes = e * shard_numel;
  f.reduced_bytes = elem(req.reduce_dtype) * shard_numel;
  f.state_tensors = req.optimizer_state_tensors;
  f.state_element_bytes = static_cast<int>(elem(req.optimizer_state_dtype));
  f.gathers = gathers;
  f.device_is_cpu = req.device == c10::kCPU;
  f.gathers_at_all = N > 1 || req.param_dtype != at::kFloat || where.master != OffloadTier::kNone;
  const offload::TierBytes held = offload::state_bytes(where, kind, f);
  for (int t = 0; t < 3; ++t) s.tier.bytes[t] += held.bytes[t];
  s.loaded[where.master] += f.master_bytes;
  if (where.working_copy) s.loaded[OffloadTier::kNone] += f.compute_bytes;
  s.master_on_disk = s.master_on_disk || (where.master == OffloadTier::kDisk && master_bytes > 0);
  s.cast_working = s.cast_working || (where.working_copy && e != 4);
  if (kind.trainable && req.load == LoadKind::kResume) {
    s.loaded[where.optimizer_state] += f.state_tensors * (master_bytes / 4) * f.state_element_bytes;
  }
  if (kind.stored_frozen) s.stored_largest = std::max(s.stored_largest, 4 * shard_numel);
  s.master += master_bytes;
  if (where.working_copy) s.working += f.compute_bytes;
  if (kind.trainable) {
    s.grads += master_bytes;
    s.optimizer += f.state_tensors * (master_bytes / 4) * f.state_element_bytes;
  }
  return {where, kind, f, unit};
}

// Each unit's flat params placed and their I/O counted by the runtime's rules (offload/placement.h).
States sharded_states(const ModelShape& shape, const PlanRequest& req, const Choices& c, int N) {
  States s;
  const auto policy = OffloadPolicy().params(c.params).grads(c.grads).optimizer_state(c.optimizer_state);
  const bool stager = offload::needs_stager(policy, req.device == c10::kCPU);
  const size_t n = shape.units.size();
  const std::vector<bool> backward = runs_backward(shape);
  std::vector<int> gathers(n);
  std::vector<int64_t> disk_reads(n, 0);  // whole pages of each unit's disk-tier reads
  std::vector<Placed> placed;
  for (size_t i = 0; i < n; ++i) {
    const auto& u = shape.units[i];
    // The root and the last unit to run forward keep their params for backward; a unit resharded to
    // a group gathers its parts in backward, reading no master.
    const AfterForward after = after_forward(u, i + 1 == n, req, c, N);
    gathers[i] = after.keeps || after.group > 0 || !backward[i] ? 1 : 2;
    auto add = [&](offload::FlatParamKind kind, int64_t shard_numel, int64_t master_bytes) {
      placed.push_back(place_flat(s, req, policy, stager, N, i, kind, shard_numel, master_bytes, gathers[i]));
      const offload::StateTiers& where = placed.back().where;
      if (where.master == OffloadTier::kDisk && !where.working_copy)
        disk_reads[i] += offload::whole_pages(master_bytes);
    };
    // Replicated adapters (PlanRequest::replicate_adapters): whole on every rank, never gathered.
    const int64_t st = replicated_trainable(u, req) ? u.trainable_numel : ceil_div(u.trainable_numel, N);
    if (st > 0) add({true, false}, st, 4 * st);
    for (const auto& [storage, numel] : frozen_parts(u, req.param_dtype)) {
      add({false, storage != FrozenStorage::kFloat32}, ceil_div(numel, N), stored_bytes(storage, numel, N));
      if (req.nf4_codes_in_place && storage == FrozenStorage::kNF4 && placed.back().where.master == OffloadTier::kDisk)
        s.tier[OffloadTier::kDisk] -= ceil_div(numel, N) / 2;  // read from the imported files
    }
  }
  const std::vector<bool> kept = forward_reads_kept(shape, c, gathers, disk_reads);
  for (Placed& p : placed) {
    p.f.forward_kept = kept[p.unit];
    s.io += offload::step_io(p.where, p.kind, p.f);
  }
  return s;
}

int64_t disk_window(const Choices& c, int state_tensors) {
  if (c.params != OffloadTier::kDisk && c.grads != OffloadTier::kDisk && c.optimizer_state != OffloadTier::kDisk) {
    return 0;
  }
  // The streamed step's window (offload/tier_rules.h), its chunks at most the tier's for every
  // tensor streamed (master, gradient, states): 3 chunks of 4 MiB per tensor without a budget.
  const int streamed = state_tensors + 2;
  const int64_t chunk = offload::chunk_elements(c.disk_memory_budget, streamed);
  return offload::step_window(c.disk_memory_budget, streamed * offload::whole_pages(4 * chunk));
}

void add_traffic(const ModelShape& shape, const PlanRequest& req, const Choices& c, int N, Plan& p) {
  const int64_t e = elem(req.param_dtype), r = elem(req.reduce_dtype);
  int64_t gathers = 0, gathered = 0, reduced = 0, in_groups = 0, replicated = 0;
  const bool kept = c.keep_gathered && p.grad_accum_steps > 1;
  const size_t last_layer = shape.units.empty() ? 0 : shape.units.size() - 1;
  const std::vector<bool> backward = runs_backward(shape);
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const auto& u = shape.units[i];
    if (u.vocab_parallel) continue;  // never gathered, frozen (its loss's few hidden states are not counted)
    const bool whole = replicated_trainable(u, req);
    const int64_t s = (whole ? 0 : ceil_div(u.trainable_numel, N) * e) + frozen_bytes(u, req.param_dtype, N);
    // after_forward: the units that keep their params gather once per micro-batch; kept across the
    // micro-batches (Choices::keep_gathered), every unit is gathered once per step. Resharded to a
    // group, backward gathers the parts within it.
    const AfterForward after = after_forward(u, i == last_layer, req, c, N);
    const int k = kept ? 0 : after.group;
    const int times = after.keeps || !backward[i] ? 1 : 2;
    gathers += times;
    gathered += (kept ? 1 : (k > 0 ? 1 : times) * p.grad_accum_steps) * s;  // frozen shards in their stored form
    if (k > 0) in_groups += p.grad_accum_steps * (k - 1) * (gathered_bytes(u, req, N) / k);
    (whole ? replicated : reduced) += (whole ? u.trainable_numel : ceil_div(u.trainable_numel, N)) * r;
  }
  const int64_t hops = N - 1;
  p.group_all_gather_bytes = in_groups;
  p.gathers_per_step = c.strategy == ShardingStrategy::kNoShard ? 0
                       : kept                                   ? static_cast<int64_t>(shape.units.size())
                                                                : gathers;
  p.all_gather_bytes = c.strategy == ShardingStrategy::kNoShard ? 0 : hops * gathered + in_groups;
  // Reductions per step: once with no-sync accumulation, per micro-batch otherwise; the replicas'
  // all-reduce once unless every micro-batch reduces in full.
  const int64_t accum = p.grad_accum_steps;
  const int64_t scatters = req.accumulation == Accumulation::kNoSync ? 1 : accum;
  const int64_t all_reduces = req.accumulation == Accumulation::kReduce ? accum : 1;
  p.reduce_bytes = scatters * hops * reduced;
  if (c.strategy == ShardingStrategy::kNoShard || c.strategy == ShardingStrategy::kHybridShard) {
    // An all-reduce across the replicas: twice the shard, scaled by (replicas - 1) / replicas.
    const int replicas = req.ranks_per_node * req.nodes / N;
    if (replicas > 1) p.reduce_bytes += all_reduces * (2 * reduced * (replicas - 1) / replicas);
  }
  // Replicated adapters: an all-reduce over every rank, each reduction (the replicas' rule).
  const int world = req.ranks_per_node * req.nodes;
  if (world > 1) p.reduce_bytes += all_reduces * (2 * replicated * (world - 1) / world);
}

// Note [Resharding to a group] (shard/sharded_unit.cpp): each unit's 1/k of its gathered buffers,
// held from its forward to its backward.
int64_t post_forward_parts(const ModelShape& shape, const PlanRequest& req, const Choices& c, int64_t accum, int N) {
  if (c.keep_gathered && accum > 1) return 0;
  int64_t parts = 0;
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const AfterForward after = after_forward(shape.units[i], i + 1 == shape.units.size(), req, c, N);
    if (after.group > 0) parts += gathered_bytes(shape.units[i], req, N) / after.group;
  }
  return parts;
}

// Whether every unit keeps its gathered params from forward to backward.
bool keeps_all_after_forward(const ModelShape& shape, const PlanRequest& req, const Choices& c, int N) {
  for (size_t i = 0; i < shape.units.size(); ++i) {
    if (!after_forward(shape.units[i], i + 1 == shape.units.size(), req, c, N).keeps) return false;
  }
  return true;
}

// The most gathered parameters alive at once, in the compute dtype, and what they are: the units
// that keep theirs from forward to backward (the root, the last unit) and have run forward, plus
// the unit computing and the `prefetch_depth` after it, at every moment of forward and backward.
// Units that run no backward (runs_backward) are not gathered in it.
std::pair<int64_t, std::string> gathered_peak(const ModelShape& shape, const PlanRequest& req, const Choices& c,
                                              int N) {
  const size_t n = shape.units.size();
  const int64_t e = elem(req.param_dtype);
  const std::vector<bool> backward = runs_backward(shape);
  std::vector<bool> keeps(n);
  for (size_t i = 0; i < n; ++i) keeps[i] = after_forward(shape.units[i], i + 1 == n, req, c, N).keeps;
  int64_t best = -1;
  std::string what;
  const bool layers_only = std::all_of(shape.units.begin(), shape.units.end(),
                                       [](const UnitShape& u) { return u.is_root || u.checkpointable; });
  // The moment unit i computes: `order` lists i and the next prefetch_depth units in the direction of travel.
  auto moment = [&](size_t i, const std::vector<size_t>& order) {
    int64_t bytes = 0, window = 0;
    std::string held;
    for (size_t j = 0; j < i; ++j) {
      if (!keeps[j]) continue;
      bytes += e * gathered_numel(shape.units[j], req, c);
      held += (held.empty() ? "" : ", ") + (shape.units[j].is_root ? std::string("root") : shape.units[j].name);
    }
    for (size_t j : order) {  // the unit computing and the prefetched ones
      bytes += e * gathered_numel(shape.units[j], req, c);
      if (j == i || !keeps[j]) ++window;
    }
    if (bytes > best) {
      best = bytes;
      what = (held.empty() ? std::string("") : held + " + ") + std::to_string(window) +
             (layers_only ? " layer(s)" : " unit(s)");
    }
  };
  for (size_t i = 0; i < n; ++i) {
    if (shape.units[i].is_root) continue;
    std::vector<size_t> order;
    for (size_t j = i; j < n && order.size() <= static_cast<size_t>(req.prefetch_depth); ++j) order.push_back(j);
    moment(i, order);
  }
  for (size_t i = n; i-- > 0;) {
    if (shape.units[i].is_root || !backward[i]) continue;
    std::vector<size_t> order;
    for (size_t j = i + 1; j-- > 0 && order.size() <= static_cast<size_t>(req.prefetch_depth);) {
      if (j == i || (backward[j] && !keeps[j] && !shape.units[j].is_root)) order.push_back(j);
    }
    moment(i, order);
  }
  if (best < 0) return {e * shape.numel(), "root"};  // the root alone
  return {best, what};
}

// Note [Two moments of backward]
// At the start of backward the activations are alive, the gathered params at their peak (root,
// the layer computing, the one prefetched) and two layers' gradient buffers (one filled, one
// reduced). At the end the root's reduction is issued from the post-hook of its last gradient,
// which autograd keeps alive until the hooks return; every layer has resharded, and a unit's
// post-backward has collected the reductions before it, so one layer's buffer at most waits. So
// the layers' gathered params and a second layer's buffer count at the start only (at both, the
// plan of Llama-3.2-1B's full fine-tune with the state on disk was 348 MiB high: 0.89x). The
// units that are not layers (layers_of: the root, an embedding or a head of its own) stay at both,
// and so does everything with kept gathers, which outlive backward.
//
// The start itself is two moments apart. First the loss's backward (the extra of the units that
// are not layers): the layers gathered then are those kept from forward and what the root's
// prefetch adds (the first prefetch_depth layers in backward that were not kept). Then the first
// layer's backward: the gathered params at their peak, its rebuilt activations and its own extra,
// the loss's gradients freed. The plan counts the larger (both at once, the plan of Llama-3.2-1B's
// QLoRA with checkpointing was 0.89x of the resume's peak).
LayersGathered add_gathered(const ModelShape& shape, const PlanRequest& req, const Choices& c, int N, int64_t e,
                            Plan& p) {
  PlanTier& ram = p.device;
  if (keeps_all_after_forward(shape, req, c, N)) {
    ram.add("gathered params (all, forward to backward)", e * shape.numel());
    return {};
  }
  if (c.keep_gathered && p.grad_accum_steps > 1) {
    ram.add("gathered params (all, kept across micro-batches)", e * shape.numel());
    return {};
  }
  const auto [bytes, what] = gathered_peak(shape, req, c, N);
  const std::vector<bool> layer = layers_of(shape);
  const std::vector<bool> backward = runs_backward(shape);
  int64_t not_layers = 0, at_loss = 0, prefetched = 0;
  for (size_t i = shape.units.size(); i-- > 0;) {
    const int64_t g = e * gathered_numel(shape.units[i], req, c);
    if (!layer[i]) {
      not_layers += g;
      continue;
    }
    const bool keeps = after_forward(shape.units[i], i + 1 == shape.units.size(), req, c, N).keeps;
    const bool in_reach = backward[i] && prefetched++ < req.prefetch_depth;
    if (keeps || in_reach) at_loss += g;
  }
  const int64_t at_end = c.keep_gathered ? bytes : std::min(bytes, not_layers);
  if (at_end == bytes) {
    ram.add("gathered params (" + what + ")", bytes);
    return {};
  }
  ram.add("gathered params (the units that are not layers)", at_end);
  return {bytes - at_end, std::min(at_loss, bytes - at_end), what};
}

// What the step itself allocates beyond the sharded states (Note [The planner's arithmetic]).
void add_working_set(const ModelShape& shape, const PlanRequest& req, const Choices& c, int N, bool working_copy,
                     Plan& p) {
  PlanTier& ram = p.device;
  const Sizes z = sizes_of(shape);
  const int64_t e = elem(req.param_dtype);
  const bool keeps_all = c.strategy == ShardingStrategy::kShardGradOp || c.strategy == ShardingStrategy::kNoShard;
  const bool gathers = N > 1 || req.param_dtype != at::kFloat || c.params != OffloadTier::kNone || working_copy;
  const LayersGathered layers_gathered = gathers ? add_gathered(shape, req, c, N, e, p) : LayersGathered{};
  const int64_t parts = post_forward_parts(shape, req, c, p.grad_accum_steps, N);
  if (parts > 0) {
    ram.add("parts kept after forward (groups of " + std::to_string(req.reshard_after_forward_group) + ")", parts,
            PlanTier::kBackwardStart);
  }
  const int64_t grad_layers = std::min<int64_t>(2, std::max<int64_t>(z.units - 1, 0));
  const ActivationBytes acts = req.seq_len > 0 ? activations(shape, req, c) : ActivationBytes{};
  const int64_t extra = acts.largest_extra();
  if (shape.trainable_numel() > 0) {
    const int64_t end_layers = std::min<int64_t>(1, grad_layers);
    ram.add("gradient buffers (root + " + std::to_string(end_layers) + " layer(s))",
            e * (z.root_trainable + z.other_max_trainable + end_layers * z.layer_max_trainable));
    ram.add("a second layer's gradient buffer (one filled, one reduced)",
            e * (grad_layers - end_layers) * z.layer_max_trainable, PlanTier::kBackwardStart);
    // Made once the loss's backward (the root's backward extra) is over, and copied at once: alive
    // with the largest backward extra's moment only beyond it (measured: a 152k-token head, fp32,
    // whole and chunked logits).
    ram.add("the head's gradient before its copy, beyond the largest backward extra",
            std::max<int64_t>(0, e * z.largest_trainable - extra), PlanTier::kBackwardStart);
    ram.add("the embedding's gradient before its copy (largest parameter)", e * z.largest_trainable,
            PlanTier::kBackwardEnd);
    // The reduction in flight of the largest unit: its gradient cast to reduce_dtype (unless it is
    // the compute dtype) and the reduced shard, alive until the optimizer collects it.
    const int64_t r = elem(req.reduce_dtype);
    const int64_t reducing =
        (r != e ? r * z.unit_max_trainable : 0) + (N > 1 ? r * ceil_div(z.unit_max_trainable, N) : 0);
    ram.add("the root's reduction in flight (largest unit)", reducing, PlanTier::kBackwardEnd);
  }
  if (req.device == c10::kCPU && gathers && N > 1) {
    // A layer's freed frozen block waits beside the loss's backward under activation checkpointing;
    // without it the first layer's gradient buffer frees it before the peak (measured at 0.5B-8B).
    const int64_t frozen = c.checkpoint_every > 0 ? e * z.layer_max_frozen_part : 0;
    ram.add(std::string("freed blocks kept for reuse (2 of a layer's trainable size") +
                (frozen > 0 ? ", 1 of its largest frozen part)" : ")"),
            2 * e * z.layer_max_trainable + frozen);
  }
  add_backward_start(layers_gathered, acts, p);
  if (p.grad_accum_steps > 1 && !keeps_all && req.accumulation == Accumulation::kNoSync) {
    ram.add(
        "unreduced gradients across micro-batches",
        e * (shape.trainable_numel() - z.root_trainable - z.other_max_trainable - grad_layers * z.layer_max_trainable));
  }
  const int replicas = req.ranks_per_node * req.nodes / N;
  if (p.grad_accum_steps > 1 && replicas > 1 && req.accumulation == Accumulation::kReduceScatter) {
    // Note [Accumulation without the all-reduce] (shard/grad_cycle.cpp): an fp32 shard per trainable flat param.
    int64_t shards = 0;
    for (const auto& u : shape.units) shards += ceil_div(u.trainable_numel, N);
    ram.add("partial gradient sums awaiting the replicas' all-reduce", 4 * shards);
  }
}

}  // namespace

int64_t default_process_host_bytes(c10::DeviceType device) {
  // fsdp-train --init-only on this project's CPU builds: LibTorch, the communicator and its shared-memory
  // channels, the worker threads. A CUDA process adds the runtime's host side.
  return device == c10::kCPU ? int64_t{350} << 20 : int64_t{3} << 30;
}

int64_t default_process_device_bytes(c10::DeviceType device) {
  return device == c10::kCPU ? 0 : int64_t{1} << 30;  // the CUDA context, cuBLAS and NCCL workspaces
}

int shard_size_of(ShardingStrategy strategy, const PlanRequest& req) {
  switch (strategy) {
    case ShardingStrategy::kNoShard: return 1;
    case ShardingStrategy::kHybridShard: return req.ranks_per_node;
    default: return req.ranks_per_node * req.nodes;
  }
}

// Note [The compute libraries' first use]
// A process that has only joined the job (fsdp-train --init-only: the process item) has not mapped
// the CPU's matrix kernels nor their work buffers: a first linear layer's forward and backward with
// a cross-entropy loss adds 16.6 MiB of RSS in fp32, 26.0 in bf16, whatever its size (an AMD EPYC;
// about 35 after a bf16 step with AMX). A step holds them; a load or a save computes nothing.
int64_t compute_libraries(const PlanRequest& req) {
  return req.param_dtype == at::kFloat ? int64_t{16} << 20 : int64_t{32} << 20;
}

// What a step holds for the saves: an async save's snapshot (`snapshot` bytes), or, PlanRequest::
// save_in_step resolved, a checkpoint writer per file when a save follows the step.
void add_saves_in_step(const PlanRequest& req, const Choices& c, int64_t snapshot, PlanTier& host, Plan& p) {
  if (req.async_save) host.add("async save's snapshot", snapshot);
  p.save_in_step =
      req.saves && req.save_in_step.value_or(save_in_step_pays(c.params, c.optimizer_state, req.async_save));
  if (!p.save_in_step) return;
  host.add("a save written during the step: a checkpoint writer per file (two buffers each)",
           (1 + req.optimizer_state_tensors) * io::DirectWriter::memory_bytes(io::DirectWriter::kInStepBufferBytes));
}

Plan cost(const ModelShape& shape, const PlanRequest& req, const Choices& c) {
  Plan p;
  const int N = shard_size_of(c.strategy, req);
  const bool cpu = req.device == c10::kCPU;
  p.strategy = c.strategy;
  p.shard_size = N;
  p.params = c.params;
  p.grads = c.grads;
  p.optimizer_state = c.optimizer_state;
  p.checkpoint_every = c.checkpoint_every;
  p.micro_batch = c.micro_batch;
  p.keep_gathered = c.keep_gathered;
  p.grad_accum_steps = ceil_div(std::max<int64_t>(req.batch_per_rank, 1), c.micro_batch);
  p.disk_memory_budget = disk_window(c, req.optimizer_state_tensors);
  const States s = sharded_states(shape, req, c, N);
  // On the CPU the device is the host: one RAM, one list.
  PlanTier& host = cpu ? p.device : p.host;
  host.add("process (libraries, communicator, threads)", process_host_bytes(req));
  if (cpu) host.add("the compute libraries' code and work buffers, from the first step on", compute_libraries(req));
  if (!cpu)
    p.device.add("process (CUDA context, workspaces)",
                 req.process_device_bytes.value_or(default_process_device_bytes(req.device)));
  p.device.add("sharded states not offloaded", s.tier[OffloadTier::kNone]);
  host.add("sharded states in the host tier", s.tier[OffloadTier::kHost]);
  p.disk.add("sharded states in the disk tier", s.tier[OffloadTier::kDisk]);
  add_working_set(shape, req, c, N, s.working > 0, p);
  host.add("disk tier's mapped window", p.disk_memory_budget);
  add_saves_in_step(req, c, s.master + s.optimizer, host, p);
  PhaseInputs phases;
  phases.process =
      cpu ? process_host_bytes(req) : req.process_device_bytes.value_or(default_process_device_bytes(req.device));
  phases.loaded = s.loaded[OffloadTier::kNone];
  phases.at_rest = s.tier[OffloadTier::kNone];
  phases.stored_largest = s.stored_largest;
  phases.master_on_disk = s.master_on_disk;
  phases.state_on_disk =
      c.params == OffloadTier::kDisk || c.grads == OffloadTier::kDisk || c.optimizer_state == OffloadTier::kDisk;
  phases.state_via_host = !cpu || req.optimizer_state_dtype != at::kFloat;
  phases.working_cast_element = s.cast_working ? elem(req.param_dtype) : 0;
  // read_streamed's chunks: the tier's chunk for two tensors (offload/tier_rules.h).
  if (phases.state_on_disk && cpu) phases.disk_read_chunk = 4 * offload::chunk_elements(c.disk_memory_budget, 2);
  phases.snapshot = cpu && req.async_save ? s.master + s.optimizer : 0;
  const Sizes z = sizes_of(shape);
  phases.largest_param = z.largest_param;
  phases.largest_trainable = z.largest_trainable;
  phases.has_frozen = shape.trainable_numel() < shape.numel();
  add_phases(req, phases, p);
  p.io_per_step = {s.io.disk_read, s.io.disk_write, s.io.to_device, s.io.to_host};
  add_traffic(shape, req, c, N, p);
  const int64_t device_budget = cpu ? req.budget.host_bytes : req.budget.device_bytes;
  p.margin_bytes = static_cast<int64_t>(static_cast<double>(device_budget) * req.margin);
  p.fits = p.peak() <= device_budget - p.margin_bytes && (cpu || p.host.total() <= req.budget.host_bytes) &&
           p.disk.total() <= req.budget.disk_bytes;
  return p;
}

}  // namespace fsdp::planning
