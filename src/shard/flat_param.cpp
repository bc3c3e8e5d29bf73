// FlatParam: layout, master shard, and the gather / free / reduce cycle of one flat buffer.
// See Note [Flat buffer lifetime] in flat_param.h.
#include "shard/flat_param.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <ATen/native/Resize.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "kernels/ops.h"
#include "offload/device_stager.h"
#include "offload/disk_tier.h"
#include "shard/param_data.h"

namespace fsdp {
namespace {

// Grows or frees a buffer's memory without touching its sizes, so views of it stay valid.
// See Note [Freeing device buffers].
void set_storage_alive(const at::Tensor& t, bool alive) {
  const size_t bytes = alive ? static_cast<size_t>(t.numel()) * t.element_size() : 0;
  if (t.storage().nbytes() == bytes) return;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (t.device().is_cpu()) {
    at::native::resize_bytes_cpu(storage, bytes);
    return;
  }
  // Note [Freeing device buffers]
  // On a device the old bytes are never wanted (a buffer is freed whole and refilled whole by
  // the next all-gather or zero_), so the storage gets a fresh allocation from its own allocator
  // (the CUDA caching allocator, which allocates on the current device: hence the guard) instead
  // of resize's allocate-copy-free. Dropping the old DataPtr returns its block to the pool of the
  // stream it was allocated on, the compute stream. That is safe because callers free only after
  // CommHandle::wait, which orders the waiting thread's stream after the collective (Note
  // [Collectives on the caller's stream]) and returns once the collective has completed.
  c10::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) {
    throw ConfigError("fsdp: cannot free a flat buffer on " + t.device().str() + ": its storage has no allocator");
  }
  const c10::DeviceGuard on_device(t.device());
  storage->set_data_ptr_noswap(bytes == 0 ? at::DataPtr(nullptr, t.device()) : allocator->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace

FlatParam::FlatParam(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
                     Communicator& replicate_group)
    : entries_(std::move(entries)),
      config_(std::move(config)),
      shard_group_(shard_group),
      replicate_group_(replicate_group) {
  const int64_t world = shard_group_.size();
  for (auto& e : entries_) {
    e.shape = e.param.sizes().vec();
    e.numel = e.param.numel();
    e.offset = numel_;
    numel_ += e.numel;
  }
  padded_numel_ = (numel_ + world - 1) / world * world;
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
  const auto device = config_.device;
  if (meta) {
    // Left untouched (so not resident) until materialize() or set_offload() fills it: only the
    // padding at the end of the flat buffer is zeroed here.
    sharded_param_ = at::empty({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(device));
    const int64_t pad = std::clamp<int64_t>(numel_ - shard_offset_, 0, shard_numel_);
    sharded_param_.narrow(0, pad, shard_numel_ - pad).zero_();
  } else {
    sharded_param_ = at::zeros({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  needs_materialize_ = meta;
  if (!meta) {
    // Copy each parameter's overlap with this rank's shard; the full flat buffer is never built.
    const int64_t lo = shard_offset_, hi = shard_offset_ + shard_numel_;
    c10::NoGradGuard no_grad;
    for (const auto& e : entries_) {
      const int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
      if (a >= b) continue;
      sharded_param_.narrow(0, a - lo, b - a).copy_(e.param.detach().reshape({-1}).narrow(0, a - e.offset, b - a));
    }
  }
  aliases_master_ = world == 1 && config_.compute_dtype == at::kFloat;
  if (aliases_master_) {
    unsharded_ = sharded_param_;
  } else {
    unsharded_ = at::empty({padded_numel_}, at::TensorOptions().dtype(config_.compute_dtype).device(device));
  }
  use_unsharded_views();  // views are created while the storage has its bytes (bounds-checked)
  make_guards();
  if (!aliases_master_) {
    set_storage_alive(unsharded_, false);
    use_guards();
  }
  state_ = aliases_master_ ? ShardedState::kUnsharded : ShardedState::kSharded;
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
    if (config_.requires_grad) grad_guards_.push_back(make_param_guard(e.param, guard_info_, e.name, true));
  }
}

void FlatParam::guard_grads() {
  for (size_t i = 0; i < grad_guards_.size(); ++i) entries_[i].param.mutable_grad() = grad_guards_[i];
  grads_guarded_ = !grad_guards_.empty();
}

void FlatParam::unguard_grads() {
  if (!grads_guarded_) return;
  if (grads_prepared_) {
    point_grads_at_buffer();
    return;
  }
  for (size_t i = 0; i < grad_guards_.size(); ++i) entries_[i].param.mutable_grad() = at::Tensor();
  grads_guarded_ = false;
}

void FlatParam::point_grads_at_buffer() {
  for (auto& e : entries_) {
    e.param.mutable_grad() = unsharded_grad_.narrow(0, e.offset, e.numel).view(e.shape);
  }
  grads_guarded_ = false;
}

void FlatParam::use_guards() {
  for (size_t i = 0; i < entries_.size(); ++i) point_param_at(entries_[i].param, guards_[i]);
}

void FlatParam::set_tag(std::string tag) {
  config_.tag = std::move(tag);
  guard_info_->unit = config_.tag.substr(0, config_.tag.rfind('/'));
}

void FlatParam::materialize(const ParamInitFn& init, const std::string& prefix) {
  if (!needs_materialize_) return;
  if (!init) {
    throw ConfigError("fsdp: parameter '" + prefix + entries_.front().name +
                      "' is on the meta device but FullyShardOptions::init is not set");
  }
  const int64_t lo = shard_offset_, hi = shard_offset_ + shard_numel_;
  c10::NoGradGuard no_grad;
  for (const auto& e : entries_) {
    const int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
    if (a >= b) continue;
    at::Tensor out = sharded_param_.narrow(0, a - lo, b - a);
    init(prefix + e.name, e.shape, a - e.offset, out);
    offload::release(out);  // disk tier: written, now out of memory (one parameter's part at a time)
  }
  needs_materialize_ = false;
  if (master_follows_state_) refresh_working(0, shard_numel_, sharded_param_);
}

void FlatParam::unshard(KeepMaster keep) {
  if (needs_materialize_) {
    throw ConfigError("fsdp: unit '" + config_.tag +
                      "' was never materialised: run the root's lazy init "
                      "(a forward through fsdp::call on the root) before using it");
  }
  if (aliases_master_ || state_ == ShardedState::kUnsharded || gather_pending_) return;
  set_storage_alive(unsharded_, true);
  if (master_follows_state_) {
    gather_input_ = working_;  // already in param_dtype on the compute device
  } else {
    // The master's values: kept from an earlier gather of this step when there is one (it has not
    // changed: every write of the master drops it), else read through the tier's I/O threads.
    const bool reused = kept_master_.defined();
    const at::Tensor master = reused ? kept_master_ : fetch_master();
    kept_master_ = at::Tensor();
    if (offload::is_disk_backed(sharded_param_)) {
      if (keep == KeepMaster::kForBackward) {
        kept_master_ = reused ? master : offload_.disk->count_in_budget(master);
      } else if (keep == KeepMaster::kForStep && config_.requires_grad) {
        kept_master_ = master;  // one shard's host buffer, kept until the unit's step
      }
    }
    if (config_.compute_dtype == at::kFloat) {
      gather_input_ = master;
    } else {  // mixed-precision copy-in (kernels/ops.h)
      gather_input_ = at::empty({master.numel()}, master.options().dtype(config_.compute_dtype));
      kernels::copy_in(master, gather_input_);
    }
  }
  stage_gather_input();
  if (shard_group_.size() == 1) {
    unsharded_.copy_(gather_input_);
    gather_input_ = at::Tensor();
    after_gather();
    state_ = ShardedState::kUnsharded;
    use_unsharded_views();
    return;
  }
  gather_handle_ = shard_group_.all_gather(unsharded_, gather_input_, config_.tag);
  gather_pending_ = true;
}

void FlatParam::wait_for_unshard() {
  if (!gather_pending_) return;
  gather_pending_ = false;
  gather_handle_.wait();
  gather_handle_ = CommHandle();
  gather_input_ = at::Tensor();
  after_gather();
  state_ = ShardedState::kUnsharded;
  use_unsharded_views();
}

void FlatParam::reshard() {
  if (aliases_master_) return;
  wait_for_unshard();  // never free memory a collective is still writing
  set_storage_alive(unsharded_, false);
  use_guards();
  state_ = ShardedState::kSharded;
}

void FlatParam::prepare_gradients() {
  finalize_grads();  // the buffer may still belong to the last step's reduce-scatter
  if (!config_.requires_grad) return;
  if (!grads_prepared_) {
    if (!unsharded_grad_.defined()) {
      unsharded_grad_ = at::zeros({padded_numel_}, unsharded_.options());
    } else {
      set_storage_alive(unsharded_grad_, true);
      unsharded_grad_.zero_();
    }
  }
  // Accumulating (no sync), the buffer is already there; .grad is guarded since the last backward.
  if (!grads_prepared_ || grads_guarded_) point_grads_at_buffer();
  grads_prepared_ = true;
}

void FlatParam::reduce_scatter_grads() {
  if (!grads_prepared_ || reduce_issued_) return;
  // The buffer now belongs to the collective: detach the params' views from it.
  guard_grads();
  reduce_input_ = config_.reduce_dtype == unsharded_grad_.scalar_type() ? unsharded_grad_
                                                                        : unsharded_grad_.to(config_.reduce_dtype);
  if (shard_group_.size() == 1) {
    reduce_output_ = reduce_input_;
  } else {
    reduce_output_ = at::empty({shard_numel_}, reduce_input_.options());
    reduce_handle_ = shard_group_.reduce_scatter(reduce_output_, reduce_input_, ReduceOp::kAvg, config_.tag);
  }
  reduce_issued_ = true;
}

void FlatParam::finalize_grads() {
  if (!reduce_issued_) return;
  reduce_handle_.wait();
  reduce_handle_ = CommHandle();
  if (replicate_group_.size() > 1) {
    replicate_group_.all_reduce(reduce_output_, ReduceOp::kAvg, config_.tag).wait();
  }
  // Copy-out (kernels/ops.h) with divide_by 1: the collectives already averaged (ReduceOp::kAvg).
  stage_reduced_grad();
  if (sharded_grad_.defined()) {
    kernels::copy_out(reduce_output_, sharded_grad_, {/*divide_by=*/1.0, /*accumulate=*/true});
  } else {
    sharded_grad_ = at::empty({reduce_output_.numel()}, reduce_output_.options().dtype(at::kFloat));
    kernels::copy_out(reduce_output_, sharded_grad_);
  }
  place_grad_shard();
  reduce_input_ = at::Tensor();
  reduce_output_ = at::Tensor();
  set_storage_alive(unsharded_grad_, false);
  reduce_issued_ = false;
  grads_prepared_ = false;
}

void FlatParam::zero_grad() {
  if (sharded_grad_.defined()) sharded_grad_.zero_();
  offload::release(sharded_grad_);
}

// ---- offload -------------------------------------------------------------------------------------

namespace {

// A zero-filled fp32 tensor of `numel` elements in `tier`.
at::Tensor zeros_in(const OffloadPlacement& p, OffloadTier tier, int64_t numel, const at::TensorOptions& options,
                    const std::string& what) {
  switch (tier) {
    case OffloadTier::kDisk: return p.disk->zeros(numel, what);
    case OffloadTier::kHost: return p.stager->host_zeros(numel);
    case OffloadTier::kNone: break;
  }
  return at::zeros({numel}, options);
}

}  // namespace

void FlatParam::set_offload(OffloadPlacement placement) {
  offload_ = std::move(placement);
  c10::NoGradGuard no_grad;
  if (offload_.params != OffloadTier::kNone) {
    at::Tensor placed = zeros_in(offload_, offload_.params, shard_numel_, sharded_param_.options(),
                                 "the master shard of " + config_.tag);
    // A new placement is all zeros, padding included: deferred init fills the rest.
    if (!needs_materialize_) {
      placed.copy_(sharded_param_);
      offload::release(placed);
    }
    sharded_param_ = placed;
    if (aliases_master_) {
      // The gathered params must not be the offloaded master itself: give them their own buffer.
      aliases_master_ = false;
      unsharded_ = at::empty({padded_numel_}, at::TensorOptions().dtype(config_.compute_dtype).device(config_.device));
      use_unsharded_views();
      set_storage_alive(unsharded_, false);
      use_guards();
      state_ = ShardedState::kSharded;
    }
  }
  if (offload_.grads != OffloadTier::kNone && sharded_grad_.defined()) place_grad_shard();
  master_follows_state_ = offload_.params == OffloadTier::kNone && offload_.grads == OffloadTier::kNone &&
                          offload_.optimizer_state != OffloadTier::kNone && config_.requires_grad;
  if (master_follows_state_) move_master_to_state_tier();
}

// See Note [The master follows the optimizer state] in flat_param.h.
void FlatParam::move_master_to_state_tier() {
  at::Tensor placed = zeros_in(offload_, offload_.optimizer_state, shard_numel_,
                               sharded_param_.options().device(at::kCPU), "the master shard of " + config_.tag);
  if (!needs_materialize_) offload::copy_streamed(placed, sharded_param_.to(at::kCPU));
  working_ = at::empty({shard_numel_}, at::TensorOptions().dtype(config_.compute_dtype).device(config_.device));
  sharded_param_ = placed;
  if (aliases_master_) {
    // One rank, fp32: the parameters are views of the working copy.
    unsharded_ = working_;
    use_unsharded_views();
  }
  if (!needs_materialize_) refresh_working(0, shard_numel_, sharded_param_);
}

at::Tensor FlatParam::new_state_tensor(const std::string& what) {
  return zeros_in(offload_, offload_.optimizer_state, shard_numel_,
                  at::TensorOptions().dtype(at::kFloat).device(sharded_param_.device()), what + " of " + config_.tag);
}

bool FlatParam::crosses_to_device(OffloadTier tier) const {
  // Host-tier copies run on CPU runs too (as clones) so that CPU tests follow the host tier's
  // schedule; disk-tier data is already in host memory once read.
  return tier == OffloadTier::kHost || (tier == OffloadTier::kDisk && !config_.device.is_cpu());
}

void FlatParam::stage_gather_input() {
  if (crosses_to_device(offload_.params)) gather_input_ = offload_.stager->to_device(gather_input_);
}

// The collective reads its input whole: a disk-tier master is read into host memory by the
// tier's I/O threads (ahead of use when read_ahead() ran for it), so a gather costs 1/N of a unit
// in RAM, like mixed precision's cast, and none of the budget.
at::Tensor FlatParam::fetch_master() {
  if (!offload::is_disk_backed(sharded_param_)) return sharded_param_;
  offload::DiskTier& tier = *offload_.disk;
  start_master_read();
  const auto t0 = std::chrono::steady_clock::now();
  offload::IoTicket ticket = std::move(pending_read_);
  pending_read_ = offload::IoTicket();
  ticket.wait();
  if (Tracer* t = tier.tracer())
    t->span("fsdp::disk_read_wait", "disk wait", t0, std::chrono::steady_clock::now(), config_.tag);
  return ticket.buffer();
}

void FlatParam::read_ahead() {
  if (master_follows_state_ || !offload::is_disk_backed(sharded_param_) || kept_master_.defined()) return;
  if (state_ == ShardedState::kUnsharded || gather_pending_) return;
  start_master_read();
}

at::Tensor FlatParam::take_master_for_step() {
  at::Tensor out = std::move(kept_master_);
  kept_master_ = at::Tensor();
  return out;
}

// Issues the read of the disk-tier master unless one of its current contents is already pending.
void FlatParam::start_master_read() {
  offload::DiskTier& tier = *offload_.disk;
  if (pending_read_.valid() && pending_read_generation_ == tier.generation()) return;
  pending_read_generation_ = tier.generation();
  pending_read_ = tier.read_async(sharded_param_, 0, shard_numel_, "the master shard of " + config_.tag, false);
}

// ---- the master follows the optimizer state --------------------------------------------------------

at::Tensor FlatParam::optimizer_grad() {
  finalize_grads();
  if (!master_follows_state_ || !sharded_grad_.defined()) return sharded_grad_;
  // Through pinned staging on a device; a clone on CPU runs (the same schedule, tested there).
  return offload_.stager ? offload_.stager->to_host(sharded_grad_) : sharded_grad_;
}

std::function<void(int64_t, int64_t, const at::Tensor&)> FlatParam::after_optimizer_update() {
  if (!master_follows_state_) return nullptr;
  return [this](int64_t a, int64_t b, const at::Tensor& updated) { refresh_working(a, b, updated); };
}

void FlatParam::master_written() {
  kept_master_ = at::Tensor();
  if (offload::DiskTier* tier = offload::tier_of(sharded_param_)) tier->bump_generation();
  if (master_follows_state_) refresh_working(0, shard_numel_, sharded_param_);
}

void FlatParam::refresh_working(int64_t a, int64_t b, const at::Tensor& master_part) {
  c10::NoGradGuard no_grad;
  // A whole disk-tier master (after deferred init or a load) is read through the I/O threads.
  const at::Tensor part = offload::is_disk_backed(master_part)
                              ? offload::read_whole(master_part, "the master shard of " + config_.tag)
                              : master_part;
  at::Tensor cast = part;
  if (config_.compute_dtype != at::kFloat) {  // the same copy-in as the gather's without offload
    cast = at::empty({part.numel()}, part.options().dtype(config_.compute_dtype));
    kernels::copy_in(part, cast);
  }
  at::Tensor dst = working_.narrow(0, a, b - a);
  if (offload_.stager) {
    offload_.stager->copy_to_device(dst, cast);
  } else {
    dst.copy_(cast);
  }
}

void FlatParam::after_gather() {
  if (offload_.params != OffloadTier::kDisk) return;
  offload::release(sharded_param_);
  offload_.disk->audit();
}

void FlatParam::stage_reduced_grad() {
  if (crosses_to_device(offload_.grads)) reduce_output_ = offload_.stager->to_host(reduce_output_);
}

void FlatParam::place_grad_shard() {
  if (offload_.grads == OffloadTier::kNone) return;
  if (offload_.grads == OffloadTier::kDisk && !offload::is_disk_backed(sharded_grad_)) {
    at::Tensor placed = offload_.disk->zeros(shard_numel_, "the gradient shard of " + config_.tag);
    placed.copy_(sharded_grad_);
    sharded_grad_ = placed;
  } else if (offload_.grads == OffloadTier::kHost && std::string(offload_.stager->name()) != "cpu" &&
             !sharded_grad_.is_pinned()) {
    at::Tensor placed = offload_.stager->host_zeros(shard_numel_);
    placed.copy_(sharded_grad_);
    sharded_grad_ = placed;
  }
  offload::release(sharded_grad_);
}

int64_t FlatParam::unsharded_bytes() const {
  return aliases_master_ ? 0 : static_cast<int64_t>(unsharded_.storage().nbytes());
}

int64_t FlatParam::unsharded_grad_bytes() const {
  return unsharded_grad_.defined() ? static_cast<int64_t>(unsharded_grad_.storage().nbytes()) : 0;
}

}  // namespace fsdp
