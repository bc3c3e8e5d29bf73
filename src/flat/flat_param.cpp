// FlatParam: its build, deferred init, loads and the optimizer's side, over its parts. See Note
// [Flat buffer lifetime] in flat_param.h.
#include "flat/flat_param.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "flat/param_data.h"
#include "fsdp/errors.h"
#include "frozen/frozen_storage.h"
#include "offload/residency.h"
#include "offload/tier_tensors.h"

namespace fsdp {
namespace {

// This rank's fp32 master shard, from the parameters' current values (meta: left for materialize).
at::Tensor build_master(const FlatLayout& layout) {
  const int64_t S = layout.shard_numel();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(layout.config().device);
  if (layout.meta()) {
    // Left untouched (so not resident) until materialize() or set_offload() fills it: only the
    // padding at the end of the flat buffer is zeroed here. Values to be quantized are zeroed by
    // materialize(), one flat param at a time: zeroed here, every frozen shard of the model would
    // be resident in fp32 at once.
    at::Tensor master = at::empty({S}, options);
    const int64_t pad = layout.values_in_shard();
    master.narrow(0, pad, S - pad).zero_();
    return master;
  }
  at::Tensor master = at::zeros({S}, options);
  // Copy each parameter's overlap with this rank's shard; the full flat buffer is never built.
  const int64_t lo = layout.shard_offset(), hi = lo + S;
  c10::NoGradGuard no_grad;
  for (const auto& e : layout.entries()) {
    const int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
    if (a >= b) continue;
    master.narrow(0, a - lo, b - a).copy_(e.param.detach().reshape({-1}).narrow(0, a - e.offset, b - a));
  }
  return master;
}

std::unique_ptr<Residency> make_residency(const FlatLayout& layout, const StoredShard& stored) {
  const FlatParamConfig& c = layout.config();
  Residency::Config where;
  where.stored = stored.active();
  where.compute_dtype = c.compute_dtype;
  where.device = c.device;
  where.requires_grad = c.requires_grad;
  where.tag = c.tag;
  where.values = layout.values_in_shard();
  return std::make_unique<Residency>(stored.initial(build_master(layout)), std::move(where));
}

}  // namespace

FlatParam::FlatParam(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
                     Communicator& replicate_group)
    : layout_(std::move(entries), std::move(config), shard_group, replicate_group),
      stored_(layout_.config().storage, layout_.config().requires_grad, layout_.meta()),
      residency_(make_residency(layout_, stored_)),
      gathered_(layout_, *residency_, stored_),
      grads_(layout_, *residency_, gathered_),
      needs_materialize_(layout_.meta()) {}

FlatParam::~FlatParam() = default;

void FlatParam::set_tag(std::string tag) {
  layout_.set_tag(std::move(tag));
  residency_->set_tag(layout_.config().tag);
  const std::string& t = layout_.config().tag;
  gathered_.guard_info()->unit = t.substr(0, t.rfind('/'));
}

void FlatParam::materialize(const ParamInitFn& init, const std::string& prefix, bool load_writes) {
  if (!needs_materialize_) return;
  awaits_load_ = load_writes;
  if (load_writes) return;  // fully_shard refused a meta flat param without an init
  const int64_t lo = shard_offset(), hi = lo + shard_numel();
  c10::NoGradGuard no_grad;
  // Values to be quantized: the gaps between parameters share their blocks, so they are zero.
  if (stored_.awaits_encode()) residency_->master().zero_();
  // A disk-tier master is filled in host chunks its tier writes (an init gives any range's values
  // alike): written through the mapping, each page would be read in before it is written.
  const at::Tensor& master = residency_->master();
  const bool in_file = offload::is_disk_backed(master) && master.scalar_type() == at::kFloat;
  offload::RangeWriter writer(master, "the master shard of " + config().tag);
  constexpr int64_t kChunk = 4 << 20;  // elements per host chunk (16 MiB)
  for (const auto& e : entries()) {
    const int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
    if (a >= b) continue;
    if (!in_file) {
      at::Tensor out = master.narrow(0, a - lo, b - a);
      init(prefix + e.name, e.shape, a - e.offset, out);
      residency_->part_written(out);
      continue;
    }
    for (int64_t c = a; c < b; c += kChunk) {
      at::Tensor out = at::empty({std::min(kChunk, b - c)}, master.options().device(at::kCPU));
      init(prefix + e.name, e.shape, c - e.offset, out);
      writer.put(c - lo, out);
    }
  }
  writer.finish();
  needs_materialize_ = false;
  stored_.encode_filled(*residency_);
  residency_->materialized();
  gathered_.alias_master();
}

void FlatParam::unshard() { unshard(KeepMaster::kNo); }

void FlatParam::unshard(KeepMaster keep) {
  if (needs_materialize_) {
    throw ConfigError("fsdp: unit '" + config().tag +
                      "' was never materialised: run the root's lazy init "
                      "(a forward through fsdp::call on the root) before using it");
  }
  gathered_.unshard(keep);
}

void FlatParam::with_shard_values(const std::function<void(const at::Tensor&)>& fn) {
  if (needs_materialize_) {
    throw ConfigError("fsdp: unit '" + config().tag + "' was never materialised: run the root's lazy init first");
  }
  at::Tensor input = residency_->gather_input(KeepMaster::kNo);
  if (stored_.active() && frozen::quantized(config().storage)) {  // blocks: decoded whole; a floating form as it is
    at::Tensor values = at::empty({shard_numel()}, input.options().dtype(config().compute_dtype));
    stored_.decode(input, values);
    input = values;
  }
  try {
    fn(input);
  } catch (...) {
    residency_->gather_done();
    throw;
  }
  residency_->gather_done();
}

// ---- the stored form of a frozen shard --------------------------------------------------------------

void FlatParam::frozen_values_into(const at::Tensor& out) const { stored_.values_into(*residency_, out); }

void FlatParam::store_frozen(const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  // What lies outside every parameter (a gap to a parameter's next block, the padding) is zero,
  // whatever a load left there: it shares a block's absmax with the parameter before it.
  layout_.zero_gaps(values);
  stored_.store(*residency_, values);
  loaded();
  gathered_.drop_stale();
}

void FlatParam::store_values(int64_t begin, const at::Tensor& values) {
  stored_.store_range(*residency_, begin, values, shard_numel(), values_in_shard());
}

bool FlatParam::store_codes_in_place(int64_t begin, int64_t count, const CodesInFile& codes) {
  return stored_.store_codes_in_place(*residency_, begin, count, codes, shard_numel(), values_in_shard());
}

void FlatParam::end_store_values() {
  stored_.end_ranges(*residency_);
  loaded();
  gathered_.drop_stale();
}

int64_t FlatParam::stored_bytes() const {
  const at::Tensor& m = residency_->master();
  return static_cast<int64_t>(m.numel() * m.element_size());
}

// ---- where the states live: forwarded to the residency ---------------------------------------------

at::Tensor& FlatParam::sharded_param() { return residency_->master(); }
const at::Tensor& FlatParam::working_shard() const { return residency_->working(); }
const OffloadPlacement& FlatParam::offload() const { return residency_->placement(); }
bool FlatParam::master_follows_state() const { return residency_->master_follows_state(); }
offload::StateTiers FlatParam::state_tiers() const { return residency_->tiers(); }
at::Tensor FlatParam::new_state_tensor(const std::string& what, at::ScalarType dtype) {
  return residency_->new_state_tensor(what, dtype);
}
at::Tensor FlatParam::take_master_for_step() { return residency_->take_master_for_step(); }
void FlatParam::values_written(int64_t begin, const at::Tensor& values) { residency_->values_written(begin, values); }
void FlatParam::master_written() {
  loaded();
  residency_->master_written();
  gathered_.drop_stale();
}

void FlatParam::loaded() {  // a load wrote the values deferred init left to it
  if (awaits_load_) awaits_load_ = needs_materialize_ = false;
}

std::function<void(int64_t, int64_t, const at::Tensor&)> FlatParam::after_optimizer_update() {
  return residency_->after_update();
}

at::Tensor FlatParam::optimizer_grad() {
  grads_.finalize();
  grads_.check_no_partial("an optimizer step");
  gathered_.master_will_change();
  return residency_->grad_for_step(grads_.shard());
}

void FlatParam::set_offload(OffloadPlacement placement) {
  c10::NoGradGuard no_grad;
  residency_->place(std::move(placement), !needs_materialize_);
  const OffloadPlacement& p = residency_->placement();
  // The gathered params must not be the offloaded master itself: they get their own buffer.
  if (p.params != OffloadTier::kNone) gathered_.unalias();
  if (p.grads != OffloadTier::kNone && grads_.shard().defined()) residency_->place_grad(grads_.shard());
  gathered_.alias_master();  // the master may have moved, or follows its state (the working copy)
}

void FlatParam::read_ahead() {
  if (gathered_.state() == ShardedState::kUnsharded || gathered_.pending() || gathered_.holds_part()) return;
  residency_->read_ahead();
}

}  // namespace fsdp
