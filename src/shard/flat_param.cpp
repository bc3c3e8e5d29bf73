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
#include <deque>
#include <mutex>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "kernels/ops.h"
#include "shard/frozen_storage.h"
#include "shard/param_data.h"
#include "offload/residency.h"
#include "offload/tier.h"

namespace fsdp {
namespace {

// Note [Reusing freed host buffers]
// On the CPU a gathered buffer of a few megabytes is its own mapping: freeing it unmaps its pages
// and the next gather's allocation faults in and zeroes new ones. On a communication-bound model
// on 2 ranks that kernel work was about a quarter of the step. A freed block is kept instead
// and handed to the next buffer of the same size from the same allocator, which in a model of
// repeated blocks is the next unit's gather or gradient. At most kKeptBlocks are kept, the most
// recently freed, so the process holds at most that many blocks beyond what is alive.
class FreedBlocks {
 public:
  static constexpr size_t kKeptBlocks = 2;

  at::DataPtr take(c10::Allocator* allocator, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      if (it->allocator == allocator && it->bytes == bytes) {
        at::DataPtr out = std::move(it->data);
        blocks_.erase(it);
        return out;
      }
    }
    return at::DataPtr(nullptr, at::Device(at::kCPU));
  }

  void keep(c10::Allocator* allocator, size_t bytes, at::DataPtr data) {
    at::DataPtr dropped(nullptr, at::Device(at::kCPU));  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back({allocator, bytes, std::move(data)});
    if (blocks_.size() > kKeptBlocks) {
      dropped = std::move(blocks_.front().data);
      blocks_.pop_front();
    }
  }

 private:
  struct Block {
    c10::Allocator* allocator;
    size_t bytes;
    at::DataPtr data;
  };
  std::mutex mu_;
  std::deque<Block> blocks_;
};

FreedBlocks& freed_host_blocks() {
  static FreedBlocks* blocks = new FreedBlocks();  // never destroyed: storages may outlive statics
  return *blocks;
}

// Grows or frees a buffer's memory without touching its sizes, so views of it stay valid.
// See Note [Freeing device buffers] and Note [Reusing freed host buffers].
void set_storage_alive(const at::Tensor& t, bool alive) {
  const size_t bytes = alive ? static_cast<size_t>(t.numel()) * t.element_size() : 0;
  if (t.storage().nbytes() == bytes) return;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (t.device().is_cpu()) {
    c10::Allocator* allocator = storage->allocator();
    if (allocator == nullptr || !storage->resizable()) {
      at::native::resize_bytes_cpu(storage, bytes);
      return;
    }
    // Whole buffers only: freed whole, and refilled whole by the next gather or zero_.
    const size_t old_bytes = storage->nbytes();
    if (bytes == 0) {
      at::DataPtr old = storage->set_data_ptr(at::DataPtr(nullptr, t.device()));
      storage->set_nbytes(0);
      if (old.get() != nullptr) freed_host_blocks().keep(allocator, old_bytes, std::move(old));
      return;
    }
    at::DataPtr fresh = old_bytes == 0 ? freed_host_blocks().take(allocator, bytes) : at::DataPtr(nullptr, t.device());
    if (fresh.get() == nullptr) {
      at::native::resize_bytes_cpu(storage, bytes);
      return;
    }
    storage->set_data_ptr_noswap(std::move(fresh));
    storage->set_nbytes(bytes);
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
  residency_ = std::make_unique<Residency>(master, std::move(where));
  aliases_master_ = world == 1 && config_.compute_dtype == at::kFloat && !stored_;
  if (aliases_master_) {
    unsharded_ = master;
  } else {
    unsharded_ = at::empty({padded_numel_}, at::TensorOptions().dtype(config_.compute_dtype).device(config_.device));
  }
  use_unsharded_views();  // views are created while the storage has its bytes (bounds-checked)
  make_guards();
  if (!aliases_master_) {
    set_storage_alive(unsharded_, false);
    use_guards();
  }
  state_ = aliases_master_ ? ShardedState::kUnsharded : ShardedState::kSharded;
}

// This rank's fp32 master shard, from the parameters' current values (meta: left for materialize).
at::Tensor FlatParam::build_master(bool meta) const {
  const auto device = config_.device;
  at::Tensor master;
  if (meta) {
    // Left untouched (so not resident) until materialize() or set_offload() fills it: only the
    // padding at the end of the flat buffer is zeroed here.
    master = at::empty({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(device));
    const int64_t pad = std::clamp<int64_t>(numel_ - shard_offset_, 0, shard_numel_);
    master.narrow(0, pad, shard_numel_ - pad).zero_();
    // Values to be quantized: the gaps between parameters share their blocks, so they are zero.
    if (stored_) master.zero_();
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
  for (size_t k = 0; k < entries_.size(); ++k) {
    FlatParamEntry& e = entries_[k];
    if (!grad_copied_.empty() && !grad_copied_[k]) {
      e.param.mutable_grad() = at::Tensor();  // its part holds no gradient yet: the first is copied in
      continue;
    }
    e.param.mutable_grad() = unsharded_grad_.narrow(0, e.offset, e.numel).view(e.shape);
  }
  grads_guarded_ = false;
}

void FlatParam::use_guards() {
  for (size_t i = 0; i < entries_.size(); ++i) point_param_at(entries_[i].param, guards_[i]);
}

void FlatParam::set_tag(std::string tag) {
  config_.tag = std::move(tag);
  residency_->set_tag(config_.tag);
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
}

at::Tensor FlatParam::frozen_values() const {
  at::Tensor values = at::empty({shard_numel_}, at::TensorOptions().dtype(at::kFloat).device(config_.device));
  if (needs_encode_) return values.copy_(residency_->master());
  frozen::decode(config_.storage, residency_->master(), values);
  return values;
}

void FlatParam::store_frozen(const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  residency_->replace_stored(frozen::encode(config_.storage, values.to(config_.device)));
  needs_encode_ = false;
  drop_stale_gather();
}

int64_t FlatParam::stored_bytes() const {
  const at::Tensor& m = residency_->master();
  return static_cast<int64_t>(m.numel() * m.element_size());
}

// The gathered stored forms, rank by rank, decoded into the compute-dtype buffer.
void FlatParam::decode_gathered() {
  const int64_t per_rank = gathered_stored_.numel() / shard_group_.size();
  c10::NoGradGuard no_grad;
  for (int r = 0; r < shard_group_.size(); ++r) {
    frozen::decode(config_.storage, gathered_stored_.narrow(0, r * per_rank, per_rank),
                   unsharded_.narrow(0, r * shard_numel_, shard_numel_));
  }
  gathered_stored_ = at::Tensor();
}

void FlatParam::unshard() { unshard(KeepMaster::kNo); }

void FlatParam::unshard(KeepMaster keep) {
  if (needs_materialize_) {
    throw ConfigError("fsdp: unit '" + config_.tag +
                      "' was never materialised: run the root's lazy init "
                      "(a forward through fsdp::call on the root) before using it");
  }
  if (aliases_master_ || state_ == ShardedState::kUnsharded || gather_pending_) return;
  set_storage_alive(unsharded_, true);
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

void FlatParam::wait_for_unshard() {
  if (!gather_pending_) return;
  gather_pending_ = false;
  gather_handle_.wait();
  gather_handle_ = CommHandle();
  gather_input_ = at::Tensor();
  if (gathered_stored_.defined()) decode_gathered();
  residency_->gather_done();
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

// Note [One-rank gradients]
// With one rank per shard, fp32 compute and reduction, and the gradient shard in no offload tier,
// the reduce-scatter is the identity and the gradient shard covers the whole flat gradient. The
// backward then accumulates straight into the gradient shard: no buffer to zero before each
// backward, no copy out after it, no second buffer. zero_grad zeroes the shard, as always. The
// sums are the same bits: the copy-out added the buffer's (0 + g) into a zeroed shard.
bool FlatParam::grads_can_alias_shard() const {
  const OffloadPlacement& p = residency_->placement();
  return aliases_master_ && shard_group_.size() == 1 && replicate_group_.size() == 1 &&
         config_.reduce_dtype == at::kFloat && unsharded_.scalar_type() == at::kFloat &&
         p.grads == OffloadTier::kNone && !residency_->master_follows_state();
}

void FlatParam::prepare_gradients() {
  finalize_grads();  // the buffer may still belong to the last step's reduce-scatter
  if (!config_.requires_grad) return;
  const bool alias = grads_can_alias_shard();
  if (grad_aliases_shard_ && !alias) {  // the placement changed: a buffer of its own
    unsharded_grad_ = at::Tensor();
    grad_aliases_shard_ = false;
  }
  if (!grads_prepared_ && alias) {
    if (!sharded_grad_.defined()) sharded_grad_ = at::zeros({padded_numel_}, unsharded_.options());
    unsharded_grad_ = sharded_grad_;
    grad_aliases_shard_ = true;
  } else if (!grads_prepared_) {
    // Note [The first gradient is copied]: not zeroed; each entry's first gradient is copied in.
    if (!unsharded_grad_.defined()) {
      unsharded_grad_ = at::empty({padded_numel_}, unsharded_.options());
    } else {
      set_storage_alive(unsharded_grad_, true);
    }
    grad_copied_.assign(entries_.size(), 0);
    for (auto& e : entries_) e.param.mutable_grad() = at::Tensor();
    grads_guarded_ = false;
    grads_prepared_ = true;
    return;
  }
  // Accumulating (no sync), the buffer is already there; .grad is guarded since the last backward.
  if (!grads_prepared_ || grads_guarded_) point_grads_at_buffer();
  grads_prepared_ = true;
}

// Note [The first gradient is copied]
// With a gradient buffer of its own (not Note [One-rank gradients]), the buffer is not zeroed
// before a step's first backward, and the parameters' .grad are left undefined, so AccumulateGrad
// takes each gradient as autograd made it. Its post-hook (gradient_landed) copies it into the
// parameter's part of the buffer and points .grad there, so what comes after (another micro-batch,
// a second contribution under reentrant recomputation) adds in place as before. Before the
// reduction, the parts no gradient reached (unused parameters) and the padding are zeroed. That
// is one copy per gradient where zeroing the buffer and adding into it was three passes. The sums
// are the same bits, except that a gradient element of -0.0 stays -0.0 instead of 0 + -0.0 = +0.0.
void FlatParam::gradient_landed(size_t k) {
  if (grad_copied_.empty() || grad_copied_[k] || reduce_issued_) return;
  FlatParamEntry& e = entries_[k];
  at::Tensor part = unsharded_grad_.narrow(0, e.offset, e.numel).view(e.shape);
  const at::Tensor& g = e.param.grad();
  c10::NoGradGuard no_grad;
  if (!g.defined()) {
    part.zero_();
  } else if (g.is_sparse()) {  // e.g. a sparse embedding's: added into zeros, as before
    part.zero_();
    part.add_(g);
  } else {
    part.copy_(g);
  }
  e.param.mutable_grad() = part;
  grad_copied_[k] = 1;
}

void FlatParam::fill_uncopied_grads() {
  if (grad_copied_.empty()) return;
  int64_t end = 0;
  for (size_t k = 0; k < entries_.size(); ++k) {
    const FlatParamEntry& e = entries_[k];
    end = std::max(end, e.offset + e.numel);
    // No gradient reached it (whatever .grad holds now is a guard or nothing).
    if (!grad_copied_[k]) unsharded_grad_.narrow(0, e.offset, e.numel).zero_();
  }
  if (end < padded_numel_) unsharded_grad_.narrow(0, end, padded_numel_ - end).zero_();
  grad_copied_.clear();
}

void FlatParam::reduce_scatter_grads() {
  if (!grads_prepared_ || reduce_issued_) return;
  fill_uncopied_grads();
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
  reduce_output_ = residency_->stage_reduced(reduce_output_);
  if (grad_aliases_shard_) {
    // Already in place (Note [One-rank gradients]).
  } else if (sharded_grad_.defined()) {
    kernels::copy_out(reduce_output_, sharded_grad_, {/*divide_by=*/1.0, /*accumulate=*/true});
  } else {
    sharded_grad_ = at::empty({reduce_output_.numel()}, reduce_output_.options().dtype(at::kFloat));
    kernels::copy_out(reduce_output_, sharded_grad_);
  }
  residency_->place_grad(sharded_grad_);
  reduce_input_ = at::Tensor();
  reduce_output_ = at::Tensor();
  if (!grad_aliases_shard_) set_storage_alive(unsharded_grad_, false);
  reduce_issued_ = false;
  grads_prepared_ = false;
}

void FlatParam::zero_grad() {
  if (sharded_grad_.defined()) sharded_grad_.zero_();
  residency_->grad_written(sharded_grad_);
}

// ---- where the states live: forwarded to the residency ---------------------------------------------

FlatParam::~FlatParam() = default;

at::Tensor& FlatParam::sharded_param() { return residency_->master(); }
const OffloadPlacement& FlatParam::offload() const { return residency_->placement(); }
bool FlatParam::master_follows_state() const { return residency_->master_follows_state(); }
const at::Tensor& FlatParam::working_shard() const { return residency_->working(); }
at::Tensor FlatParam::new_state_tensor(const std::string& what) { return residency_->new_state_tensor(what); }
at::Tensor FlatParam::take_master_for_step() { return residency_->take_master_for_step(); }
void FlatParam::master_written() {
  residency_->master_written();
  drop_stale_gather();
}

// The master was written outside a step (a load): a gather kept since the last forward (the root
// keeps its params until its backward) holds the old values; it goes, the next use gathers anew.
void FlatParam::drop_stale_gather() {
  if (aliases_master_ || (state_ != ShardedState::kUnsharded && !gather_pending_)) return;
  reshard();
}

std::function<void(int64_t, int64_t, const at::Tensor&)> FlatParam::after_optimizer_update() {
  return residency_->after_update();
}

at::Tensor FlatParam::optimizer_grad() {
  finalize_grads();
  return residency_->grad_for_step(sharded_grad_);
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
    set_storage_alive(unsharded_, false);
    use_guards();
    state_ = ShardedState::kSharded;
  }
  if (p.grads != OffloadTier::kNone && sharded_grad_.defined()) residency_->place_grad(sharded_grad_);
  if (residency_->master_follows_state() && aliases_master_) {
    // One rank, fp32: the parameters are views of the working copy.
    unsharded_ = residency_->working();
    use_unsharded_views();
  }
}

void FlatParam::read_ahead() {
  if (state_ == ShardedState::kUnsharded || gather_pending_) return;
  residency_->read_ahead();
}

int64_t FlatParam::unsharded_bytes() const {
  return aliases_master_ ? 0 : static_cast<int64_t>(unsharded_.storage().nbytes());
}

int64_t FlatParam::unsharded_grad_bytes() const {
  if (grad_aliases_shard_) return 0;  // the gradient shard's bytes
  return unsharded_grad_.defined() ? static_cast<int64_t>(unsharded_grad_.storage().nbytes()) : 0;
}

}  // namespace fsdp
