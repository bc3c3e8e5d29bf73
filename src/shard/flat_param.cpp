// FlatParam: layout, master shard, and the gather / free / reduce cycle of one flat buffer.
// See Note [Flat buffer lifetime] in flat_param.h.
#include "shard/flat_param.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "kernels/ops.h"
#include "offload/frozen_storage.h"
#include "shard/param_data.h"
#include "offload/residency.h"
#include "offload/tier_tensors.h"
#include "offload/buffer_storage.h"

namespace fsdp {

FlatParam::FlatParam(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
                     Communicator& replicate_group)
    : entries_(std::move(entries)),
      config_(std::move(config)),
      shard_group_(shard_group),
      replicate_group_(replicate_group) {
  const int64_t world = shard_group_.size();
  stored_ = !config_.requires_grad && config_.storage != FrozenStorage::kFloat32;
  const bool blocks = stored_ && frozen::quantized(config_.storage);
  for (auto& e : entries_) {
    e.shape = e.param.sizes().vec();
    e.numel = e.param.numel();
    // Quantized: each parameter starts a block, as when quantized alone (Note [Frozen storage]).
    if (blocks) numel_ = (numel_ + frozen::kBlock - 1) / frozen::kBlock * frozen::kBlock;
    e.offset = numel_;
    numel_ += e.numel;
  }
  // Quantization blocks never straddle ranks either.
  const int64_t align = world * (blocks ? frozen::kBlock : 1);
  padded_numel_ = (numel_ + align - 1) / align * align;
  shard_numel_ = padded_numel_ / world;
  shard_offset_ = shard_numel_ * shard_group_.rank();

  const bool meta = entries_.front().param.is_meta();
  for (const auto& e : entries_) {
    if (e.param.is_meta() != meta) {
      throw ConfigError("fsdp: parameter '" + e.name + "' is " + (meta ? "not " : "") +
                        "on the meta device while others of its unit are; initialise all or none lazily");
    }
    if (!meta && e.param.device() != config_.device) {
      throw ConfigError("fsdp: parameter '" + e.name + "' is on " + e.param.device().str() +
                        " but the process group computes on " + config_.device.str() +
                        " (InitOptions::device): move the module there first, or build it on the meta device");
    }
  }
  needs_materialize_ = meta;
  needs_encode_ = meta && stored_;  // fp32 values until materialize() has filled them
  at::Tensor master = build_master(meta);
  if (stored_ && !meta) master = frozen::encode(config_.storage, master);
  Residency::Config where;
  where.stored = stored_;
  where.compute_dtype = config_.compute_dtype;
  where.device = config_.device;
  where.requires_grad = config_.requires_grad;
  where.tag = config_.tag;
  where.values = values_in_shard();
  residency_ = std::make_unique<Residency>(master, std::move(where));
  // One rank (no padding unless quantized): a shard kept in the compute dtype is the gathered buffer
  // (docs/ARCHITECTURE.md, "A flat parameter's life"); deferred init's fp32 values once stored.
  aliases_master_ =
      world == 1 && (stored_ ? frozen::stored_dtype(config_.storage) : at::kFloat) == config_.compute_dtype;
  const bool alias = aliases_master_ && !needs_encode_;
  unsharded_ = alias ? master : at::empty({padded_numel_}, master.options().dtype(config_.compute_dtype));
  use_unsharded_views();  // views are created while the storage has its bytes (bounds-checked)
  make_guards();
  state_ = alias ? ShardedState::kUnsharded : ShardedState::kSharded;
  if (!alias) offload::set_storage_alive(unsharded_, false);
  if (!alias) use_guards();
}

void FlatParam::alias_master() {  // the params as views of the shard (its working copy when it follows its state)
  if (!aliases_master_ || needs_encode_) return;
  unsharded_ = residency_->master_follows_state() ? residency_->working() : residency_->master();
  use_unsharded_views();
  state_ = ShardedState::kUnsharded;
}

// This rank's fp32 master shard, from the parameters' current values (meta: left for materialize).
at::Tensor FlatParam::build_master(bool meta) const {
  const auto device = config_.device;
  at::Tensor master;
  if (meta) {
    // Left untouched (so not resident) until materialize() or set_offload() fills it: only the
    // padding at the end of the flat buffer is zeroed here.
    master = at::empty({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(device));
    const int64_t pad = values_in_shard();
    master.narrow(0, pad, shard_numel_ - pad).zero_();
    // Values to be quantized are zeroed by materialize(), one flat param at a time: zeroed here,
    // every frozen shard of the model would be resident in fp32 at once.
  } else {
    master = at::zeros({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  if (!meta) {
    // Copy each parameter's overlap with this rank's shard; the full flat buffer is never built.
    const int64_t lo = shard_offset_, hi = shard_offset_ + shard_numel_;
    c10::NoGradGuard no_grad;
    for (const auto& e : entries_) {
      const int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
      if (a >= b) continue;
      master.narrow(0, a - lo, b - a).copy_(e.param.detach().reshape({-1}).narrow(0, a - e.offset, b - a));
    }
  }
  return master;
}

void FlatParam::use_unsharded_views() {
  // The first time (construction) through set_data, which also moves meta parameters and drops a
  // stale gradient accumulator of another dtype; afterwards a plain re-pointing (the parameter is
  // a guard, which set_data would dispatch on).
  for (auto& e : entries_) {
    at::Tensor view = unsharded_.narrow(0, e.offset, e.numel).view(e.shape);
    if (guards_.empty()) {
      rebind_param_data(e.param, view);
    } else {
      point_param_at(e.param, view);
    }
  }
}

void FlatParam::make_guards() {
  guard_info_ = std::make_shared<ParamGuardInfo>();
  guard_info_->module_type = config_.module_type;
  for (auto& e : entries_) {
    guards_.push_back(make_param_guard(e.param, guard_info_, e.name));
    if (config_.requires_grad) grads_.add_guard(make_param_guard(e.param, guard_info_, e.name, true));
  }
}

void FlatParam::use_guards() {
  for (size_t i = 0; i < entries_.size(); ++i) point_param_at(entries_[i].param, guards_[i]);
}

void FlatParam::set_tag(std::string tag) {
  config_.tag = std::move(tag);
  residency_->set_tag(config_.tag);
  guard_info_->unit = config_.tag.substr(0, config_.tag.rfind('/'));
}

void FlatParam::materialize(const ParamInitFn& init, const std::string& prefix, bool load_writes) {
  if (!needs_materialize_) return;
  awaits_load_ = load_writes;
  if (load_writes) return;  // fully_shard refused a meta flat param without an init
  const int64_t lo = shard_offset_, hi = shard_offset_ + shard_numel_;
  c10::NoGradGuard no_grad;
  // Values to be quantized: the gaps between parameters share their blocks, so they are zero.
  if (needs_encode_) residency_->master().zero_();
  // A disk-tier master is filled in host chunks its tier writes (an init gives any range's values
  // alike): written through the mapping, each page would be read in before it is written.
  const at::Tensor& master = residency_->master();
  const bool in_file = offload::is_disk_backed(master) && master.scalar_type() == at::kFloat;
  offload::RangeWriter writer(master, "the master shard of " + config_.tag);
  constexpr int64_t kChunk = 4 << 20;  // elements per host chunk (16 MiB)
  for (const auto& e : entries_) {
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
  if (needs_encode_) {
    residency_->replace_stored(frozen::encode(config_.storage, master));
    needs_encode_ = false;
  }
  residency_->materialized();
  alias_master();
}

// The gathered stored forms, rank by rank, decoded into the compute-dtype buffer.
void FlatParam::decode_gathered() {
  const int64_t per_rank = gathered_stored_.numel() / shard_group_.size();
  c10::NoGradGuard no_grad;
  for (int r = 0; r < shard_group_.size(); ++r) {
    frozen::decode(config_.storage, gathered_stored_.narrow(0, r * per_rank, per_rank),
                   unsharded_.narrow(0, r * shard_numel_, shard_numel_));
  }
  // Note [Resharding to a group]: the part kept after forward is cut from the stored form.
  if (post_forward_group_ == nullptr) gathered_stored_ = at::Tensor();
}

void FlatParam::unshard() { unshard(KeepMaster::kNo); }

void FlatParam::unshard(KeepMaster keep) {
  if (needs_materialize_) {
    throw ConfigError("fsdp: unit '" + config_.tag +
                      "' was never materialised: run the root's lazy init "
                      "(a forward through fsdp::call on the root) before using it");
  }
  // Note [Kept gathers]: a gather kept since before an optimizer step holds old values.
  if (state_ == ShardedState::kUnsharded && !aliases_master_ &&
      gathered_version_ != master_version_.load(std::memory_order_relaxed)) {
    reshard();
  }
  if (aliases_master_ || state_ == ShardedState::kUnsharded || gather_pending_) return;
  if (post_forward_part_.defined()) {
    if (gathered_version_ == master_version_.load(std::memory_order_relaxed)) return gather_in_group();
    post_forward_part_ = at::Tensor();  // stale: gathered anew from the master
  }
  gathered_version_ = master_version_.load(std::memory_order_relaxed);
  offload::set_storage_alive(unsharded_, true);
  gather_input_ = residency_->gather_input(keep);
  const bool decode = stored_ && frozen::stored_dtype(config_.storage) != config_.compute_dtype;
  if (shard_group_.size() == 1) {
    if (decode) {
      c10::NoGradGuard no_grad;
      frozen::decode(config_.storage, gather_input_, unsharded_);
    } else {
      unsharded_.copy_(gather_input_);
    }
    gather_input_ = at::Tensor();
    residency_->gather_done();
    state_ = ShardedState::kUnsharded;
    use_unsharded_views();
    return;
  }
  if (decode) {  // the stored form moves; each rank decodes what it gathered
    gathered_stored_ = at::empty({gather_input_.numel() * shard_group_.size()}, gather_input_.options());
  }
  gather_handle_ = shard_group_.all_gather(decode ? gathered_stored_ : unsharded_, gather_input_, config_.tag);
  gather_pending_ = true;
}

void FlatParam::shadow_gather() {
  if (aliases_master_ || shard_group_.size() == 1) return;  // unshard() would run no collective either
  wait_for_unshard();                                       // one gather of this flat param at a time on this rank
  at::Tensor input = residency_->gather_input(KeepMaster::kNo);
  at::Tensor out = at::empty({input.numel() * shard_group_.size()}, input.options());
  shard_group_.all_gather(out, input, config_.tag).wait();
  residency_->gather_done();
}

void FlatParam::with_shard_values(const std::function<void(const at::Tensor&)>& fn) {
  if (needs_materialize_) {
    throw ConfigError("fsdp: unit '" + config_.tag + "' was never materialised: run the root's lazy init first");
  }
  at::Tensor input = residency_->gather_input(KeepMaster::kNo);
  if (stored_ && frozen::quantized(config_.storage)) {  // blocks: decoded whole; a floating form as it is
    at::Tensor values = at::empty({shard_numel_}, input.options().dtype(config_.compute_dtype));
    c10::NoGradGuard no_grad;
    frozen::decode(config_.storage, input, values);
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

void FlatParam::wait_for_unshard() {
  if (!gather_pending_) return;
  gather_pending_ = false;
  gather_handle_.wait();
  gather_handle_ = CommHandle();
  gather_input_ = at::Tensor();
  if (gathered_stored_.defined()) decode_gathered();
  if (!gathering_in_group_) residency_->gather_done();
  gathering_in_group_ = false;
  state_ = ShardedState::kUnsharded;
  use_unsharded_views();
}

void FlatParam::reshard() {
  if (aliases_master_) return;
  wait_for_unshard();  // never free memory a collective is still writing
  post_forward_part_ = at::Tensor();
  gathered_stored_ = at::Tensor();
  offload::set_storage_alive(unsharded_, false);
  use_guards();
  state_ = ShardedState::kSharded;
}

void FlatParam::reshard_to_group() {
  wait_for_unshard();
  if (post_forward_group_ == nullptr || aliases_master_ || state_ != ShardedState::kUnsharded) return reshard();
  // A stored form (int8, NF4) keeps its part as gathered: the group moves those bytes and decodes them.
  const bool stored = gathered_stored_.defined();
  const at::Tensor& from = stored ? gathered_stored_ : unsharded_;
  const int64_t part = from.numel() / post_forward_group_->size();
  at::Tensor kept = from.narrow(0, part * post_forward_group_->rank(), part).clone();
  reshard();
  post_forward_part_ = std::move(kept);
  part_stored_ = stored;
}

// The gathered params again from the parts the post-forward group's ranks kept (compute dtype, or
// the stored form, decoded once gathered): no master read.
void FlatParam::gather_in_group() {
  offload::set_storage_alive(unsharded_, true);
  gather_input_ = std::move(post_forward_part_);
  post_forward_part_ = at::Tensor();
  if (part_stored_) {
    gathered_stored_ = at::empty({gather_input_.numel() * post_forward_group_->size()}, gather_input_.options());
  }
  gather_handle_ =
      post_forward_group_->all_gather(part_stored_ ? gathered_stored_ : unsharded_, gather_input_, config_.tag);
  gather_pending_ = true;
  gathering_in_group_ = true;
}

// ---- where the states live: forwarded to the residency ---------------------------------------------

FlatParam::~FlatParam() = default;

at::Tensor& FlatParam::sharded_param() { return residency_->master(); }
const OffloadPlacement& FlatParam::offload() const { return residency_->placement(); }
bool FlatParam::master_follows_state() const { return residency_->master_follows_state(); }
offload::StateTiers FlatParam::state_tiers() const { return residency_->tiers(); }
const at::Tensor& FlatParam::working_shard() const { return residency_->working(); }
at::Tensor FlatParam::new_state_tensor(const std::string& what, at::ScalarType dtype) {
  return residency_->new_state_tensor(what, dtype);
}
at::Tensor FlatParam::take_master_for_step() { return residency_->take_master_for_step(); }
void FlatParam::values_written(int64_t begin, const at::Tensor& values) { residency_->values_written(begin, values); }
void FlatParam::master_written() {
  loaded();
  residency_->master_written();
  drop_stale_gather();
}

void FlatParam::loaded() {  // a load wrote the values deferred init left to it
  if (awaits_load_) awaits_load_ = needs_materialize_ = false;
}

// The master was written outside a step (a load): a gather kept since the last forward (the root
// keeps its params until its backward) holds the old values; it goes, the next use gathers anew.
void FlatParam::drop_stale_gather() {
  post_forward_part_ = at::Tensor();
  if (aliases_master_) return alias_master();  // a load may have replaced the stored form
  if (state_ == ShardedState::kUnsharded || gather_pending_) reshard();
}

std::function<void(int64_t, int64_t, const at::Tensor&)> FlatParam::after_optimizer_update() {
  return residency_->after_update();
}

at::Tensor FlatParam::optimizer_grad() {
  finalize_grads();
  check_no_partial_grads("an optimizer step");
  master_will_change();
  return residency_->grad_for_step(grads_.shard());
}

void FlatParam::check_no_partial_grads(const std::string& what) const {
  if (!grads_.holds_partial()) return;
  throw UsageError("fsdp: " + what + " read the gradient of " + config_.tag +
                   ", whose last reductions ran with set_requires_all_reduce(false) and were never all-reduced " +
                   "across the replicas; call set_requires_all_reduce(true) before the last micro-batch's backward");
}

void FlatParam::set_offload(OffloadPlacement placement) {
  c10::NoGradGuard no_grad;
  residency_->place(std::move(placement), !needs_materialize_);
  const OffloadPlacement& p = residency_->placement();
  if (p.params != OffloadTier::kNone && aliases_master_) {
    // The gathered params must not be the offloaded master itself: give them their own buffer.
    aliases_master_ = false;
    unsharded_ = at::empty({padded_numel_}, at::TensorOptions().dtype(config_.compute_dtype).device(config_.device));
    use_unsharded_views();
    offload::set_storage_alive(unsharded_, false);
    use_guards();
    state_ = ShardedState::kSharded;
  }
  if (p.grads != OffloadTier::kNone && grads_.shard().defined()) residency_->place_grad(grads_.shard());
  alias_master();  // the master may have moved, or follows its state (the working copy)
}

void FlatParam::read_ahead() {
  if (state_ == ShardedState::kUnsharded || gather_pending_ || post_forward_part_.defined()) return;
  residency_->read_ahead();
}

int64_t FlatParam::unsharded_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  // A stored form kept beside the gathered buffer for its part (Note [Resharding to a group]) counts too.
  return aliases_master_ ? 0
                         : static_cast<int64_t>(unsharded_.storage().nbytes()) + bytes(post_forward_part_) +
                               (post_forward_group_ != nullptr ? bytes(gathered_stored_) : 0);
}

}  // namespace fsdp
