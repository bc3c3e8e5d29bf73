// GradCycle: one flat param's gradient from its unit's backward to the optimizer. See the Notes
// below and Note [Flat buffer lifetime] in flat_param.h.
#include "flat/grad_cycle.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "kernels/ops.h"
#include "offload/residency.h"
#include "buffers/buffer_storage.h"
#include "flat/flat_layout.h"
#include "flat/gathered_params.h"
#include "flat/param_data.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace {

// Adds a reduced (already averaged) gradient into the fp32 gradient shard, which the first
// reduction creates: the copy-out of kernels/ops.h with divide_by 1.
void add_into_shard(const at::Tensor& reduced, at::Tensor& shard) {
  if (shard.defined()) {
    kernels::copy_out(reduced, shard, {/*divide_by=*/1.0, /*accumulate=*/true});
  } else {
    shard = at::empty({reduced.numel()}, reduced.options().dtype(at::kFloat));
    kernels::copy_out(reduced, shard);
  }
}

}  // namespace

GradCycle::GradCycle(FlatLayout& layout, offload::Residency& residency, const GatheredParams& gathered)
    : layout_(layout), residency_(residency), gathered_(gathered) {
  if (!layout_.config().requires_grad) return;
  for (auto& e : layout_.entries())
    guards_.push_back(make_param_guard(e.param, gathered_.guard_info(), e.name, /*gradient=*/true));
}

void GradCycle::check_no_partial(const std::string& what) const {
  if (!holds_partial()) return;
  throw UsageError("fsdp: " + what + " read the gradient of " + layout_.config().tag +
                   ", whose last reductions ran with set_requires_all_reduce(false) and were never all-reduced " +
                   "across the replicas; call set_requires_all_reduce(true) before the last micro-batch's backward");
}

void GradCycle::guard() {
  for (size_t i = 0; i < guards_.size(); ++i) layout_.entries()[i].param.mutable_grad() = guards_[i];
  guarded_ = !guards_.empty();
}

void GradCycle::unguard() {
  if (!guarded_) return;
  if (prepared_) {
    point_at_buffer();
    return;
  }
  for (size_t i = 0; i < guards_.size(); ++i) layout_.entries()[i].param.mutable_grad() = at::Tensor();
  guarded_ = false;
}

void GradCycle::point_at_buffer() {
  for (size_t k = 0; k < layout_.entries().size(); ++k) {
    FlatParamEntry& e = layout_.entries()[k];
    if (!copied_.empty() && !copied_[k]) {
      e.param.mutable_grad() = at::Tensor();  // its part holds no gradient yet: the first is copied in
      continue;
    }
    e.param.mutable_grad() = buffer_.narrow(0, e.offset, e.numel).view(e.shape);
  }
  guarded_ = false;
}

// Note [One-rank gradients]
// With one rank per shard, fp32 compute and reduction, and the gradient shard in no offload tier,
// the reduce-scatter is the identity and the gradient shard covers the whole flat gradient. The
// backward then accumulates straight into the gradient shard: no buffer to zero before each
// backward, no copy out after it, no second buffer. zero_grad zeroes the shard, as always. The
// sums are the same bits: the copy-out added the buffer's (0 + g) into a zeroed shard.
bool GradCycle::can_alias_shard() const {
  const offload::OffloadPlacement& p = residency_.placement();
  return gathered_.aliases_master() && layout_.shard_group().size() == 1 && layout_.replicate_group().size() == 1 &&
         layout_.config().reduce_dtype == at::kFloat && layout_.config().compute_dtype == at::kFloat &&
         p.grads == OffloadTier::kNone && !residency_.master_follows_state();
}

void GradCycle::prepare() {
  finalize();  // the buffer may still belong to the last step's reduce-scatter
  if (!layout_.config().requires_grad) return;
  const bool alias = can_alias_shard();
  if (aliases_shard_ && !alias) {  // the placement changed: a buffer of its own
    buffer_ = at::Tensor();
    aliases_shard_ = false;
  }
  if (!prepared_ && alias) {
    if (!shard_.defined()) shard_ = at::zeros({layout_.padded_numel()}, layout_.compute_options());
    buffer_ = shard_;
    aliases_shard_ = true;
  } else if (!prepared_) {
    // Note [The first gradient is copied]: not zeroed; each entry's first gradient is copied in.
    if (!buffer_.defined()) {
      buffer_ = at::empty({layout_.padded_numel()}, layout_.compute_options());
    } else {
      buffers::set_storage_alive(buffer_, true);
    }
    copied_.assign(layout_.entries().size(), 0);
    for (auto& e : layout_.entries()) e.param.mutable_grad() = at::Tensor();
    guarded_ = false;
    prepared_ = true;
    return;
  }
  // Accumulating (no sync), the buffer is already there; .grad is guarded since the last backward.
  if (!prepared_ || guarded_) point_at_buffer();
  prepared_ = true;
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
void GradCycle::landed(size_t k) {
  if (copied_.empty() || copied_[k] || reduce_issued_) return;
  FlatParamEntry& e = layout_.entries()[k];
  at::Tensor part = buffer_.narrow(0, e.offset, e.numel).view(e.shape);
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
  copied_[k] = 1;
}

void GradCycle::fill_uncopied() {
  if (copied_.empty()) return;
  int64_t end = 0;
  for (size_t k = 0; k < layout_.entries().size(); ++k) {
    const FlatParamEntry& e = layout_.entries()[k];
    end = std::max(end, e.offset + e.numel);
    // No gradient reached it (whatever .grad holds now is a guard or nothing).
    if (!copied_[k]) buffer_.narrow(0, e.offset, e.numel).zero_();
  }
  if (end < layout_.padded_numel()) buffer_.narrow(0, end, layout_.padded_numel() - end).zero_();
  copied_.clear();
}

void GradCycle::reduce_scatter() {
  if (!prepared_ || reduce_issued_) return;
  fill_uncopied();
  // The buffer now belongs to the collective: detach the params' views from it.
  guard();
  reduce_input_ =
      layout_.config().reduce_dtype == buffer_.scalar_type() ? buffer_ : buffer_.to(layout_.config().reduce_dtype);
  if (layout_.shard_group().size() == 1) {
    reduce_output_ = reduce_input_;
  } else {
    reduce_output_ = at::empty({layout_.shard_numel()}, reduce_input_.options());
    reduce_handle_ =
        layout_.shard_group().reduce_scatter(reduce_output_, reduce_input_, ReduceOp::kAvg, layout_.config().tag);
  }
  defer_all_reduce_ = layout_.replicate_group().size() > 1 && !requires_all_reduce_;
  // Replicated params (FullyShardOptions::replicate_params): the all-reduce is the whole reduction,
  // on a communicator of their own; issued now, it overlaps the rest of backward.
  all_reduce_issued_ =
      layout_.config().replicated && layout_.replicate_group().size() > 1 && !defer_all_reduce_ && !partial_.defined();
  if (all_reduce_issued_) {
    reduce_handle_ = layout_.replicate_group().all_reduce(reduce_output_, ReduceOp::kAvg, layout_.config().tag);
  }
  reduce_issued_ = reduced_since_zero_ = true;
}

// Note [Accumulation without the all-reduce]
// Under hybrid sharding a gradient is reduce-scattered within the replica, then all-reduced
// across the replicas. With FSDPModule::set_requires_all_reduce(false) a micro-batch's reduction
// stops after the reduce-scatter: its output (averaged over the replica) is added into partial_,
// an fp32 shard of its own, and the gradient shard is left alone. The next reduction with the
// all-reduce on adds its own output to partial_, all-reduces that sum (averaging over the
// replicas), and adds the result into the gradient shard as every reduction does. The gradient
// shard thus receives avg_replicas(sum of micro-batches) where all-reducing each micro-batch gives
// sum of avg_replicas(micro-batch): the same value, the sums associated differently (equal to fp32
// rounding; bit for bit for one micro-batch). The all-reduce runs in the reduce dtype, as always;
// partial_ is fp32 whatever the reduce dtype, so bf16 reductions are not summed in bf16.
// zero() drops partial_, as it zeroes the gradient shard.
void GradCycle::finalize_deferred() {
  if (partial_.defined()) {
    partial_.add_(reduce_output_);
  } else {
    partial_ = reduce_output_.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
}

int64_t GradCycle::partial_bytes() const {
  if (partial_.defined()) return partial_.numel() * 4;
  return reduce_issued_ && defer_all_reduce_ ? layout_.shard_numel() * 4 : 0;  // its sums, once collected
}

void GradCycle::flush_partial() {
  if (reduce_issued_ || !partial_.defined()) return;
  at::Tensor sums =
      partial_.scalar_type() == layout_.config().reduce_dtype ? partial_ : partial_.to(layout_.config().reduce_dtype);
  layout_.replicate_group().all_reduce(sums, ReduceOp::kAvg, layout_.config().tag).wait();
  partial_ = at::Tensor();
  add_into_shard(residency_.stage_reduced(sums), shard_);
  residency_.place_grad(shard_);
}

void GradCycle::finalize() {
  if (!reduce_issued_) return;
  reduce_handle_.wait();
  reduce_handle_ = CommHandle();
  if (defer_all_reduce_) {
    finalize_deferred();
    reduce_input_ = at::Tensor();
    reduce_output_ = at::Tensor();
    if (!aliases_shard_) buffers::set_storage_alive(buffer_, false);
    reduce_issued_ = false;
    prepared_ = false;
    return;
  }
  const bool with_partial = partial_.defined();
  if (with_partial) {  // Note [Accumulation without the all-reduce]: the sum, all-reduced once
    partial_.add_(reduce_output_);
    reduce_output_ =
        partial_.scalar_type() == reduce_output_.scalar_type() ? partial_ : partial_.to(reduce_output_.scalar_type());
  }
  if (layout_.replicate_group().size() > 1 && !all_reduce_issued_) {
    layout_.replicate_group().all_reduce(reduce_output_, ReduceOp::kAvg, layout_.config().tag).wait();
  }
  all_reduce_issued_ = false;
  if (with_partial) partial_ = at::Tensor();
  // The collectives already averaged (ReduceOp::kAvg).
  reduce_output_ = residency_.stage_reduced(reduce_output_);
  if (!aliases_shard_) add_into_shard(reduce_output_, shard_);  // else already in place (Note [One-rank gradients])
  residency_.place_grad(shard_);
  reduce_input_ = at::Tensor();
  reduce_output_ = at::Tensor();
  if (!aliases_shard_) buffers::set_storage_alive(buffer_, false);
  reduce_issued_ = false;
  prepared_ = false;
}

void GradCycle::zero() {
  partial_ = at::Tensor();
  reduced_since_zero_ = false;
  if (shard_.defined()) shard_.zero_();
  residency_.grad_written(shard_);
}

int64_t GradCycle::buffer_bytes() const {
  if (aliases_shard_) return 0;  // the gradient shard's bytes
  return buffer_.defined() ? static_cast<int64_t>(buffer_.storage().nbytes()) : 0;
}

}  // namespace fsdp
