// See flat/gathered_params.h.
#include "flat/gathered_params.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "flat/param_data.h"
#include "buffers/buffer_storage.h"
#include "frozen/frozen_storage.h"
#include "offload/residency.h"
#include "flat/stored_shard.h"

namespace fsdp {

GatheredParams::GatheredParams(FlatLayout& layout, offload::Residency& residency, const StoredShard& stored)
    : layout_(layout), residency_(residency), stored_(stored) {
  const FlatParamConfig& c = layout_.config();
  // One rank (no padding unless quantized): a shard kept in the compute dtype is the gathered buffer
  // (docs/ARCHITECTURE.md, "A flat parameter's life"); deferred init's fp32 values once stored.
  const at::ScalarType kept = stored_.active() ? frozen::stored_dtype(c.storage) : at::kFloat;
  aliases_master_ = layout_.shard_group().size() == 1 && kept == c.compute_dtype;
  const bool alias = aliases_master_ && !stored_.awaits_encode();
  unsharded_ = alias ? residency_.master() : at::empty({layout_.padded_numel()}, layout_.compute_options());
  use_views();  // views are created while the storage has its bytes (bounds-checked)
  guard_info_ = std::make_shared<ParamGuardInfo>();
  guard_info_->module_type = c.module_type;
  for (auto& e : layout_.entries()) guards_.push_back(make_param_guard(e.param, guard_info_, e.name));
  state_ = alias ? ShardedState::kUnsharded : ShardedState::kSharded;
  if (!alias) {
    buffers::set_storage_alive(unsharded_, false);
    use_guards();
  }
}

GatheredParams::~GatheredParams() = default;

void GatheredParams::use_views() {
  // The first time (construction) through set_data, which also moves meta parameters and drops a
  // stale gradient accumulator of another dtype; afterwards a plain re-pointing (the parameter is
  // a guard, which set_data would dispatch on).
  for (auto& e : layout_.entries()) {
    at::Tensor view = unsharded_.narrow(0, e.offset, e.numel).view(e.shape);
    if (guards_.empty()) {
      rebind_param_data(e.param, view);
    } else {
      point_param_at(e.param, view);
    }
  }
}

void GatheredParams::use_guards() {
  for (size_t i = 0; i < guards_.size(); ++i) point_param_at(layout_.entries()[i].param, guards_[i]);
}

void GatheredParams::alias_master() {  // the params as views of the shard (its working copy when it follows its state)
  if (!aliases_master_ || stored_.awaits_encode()) return;
  unsharded_ = residency_.master_follows_state() ? residency_.working() : residency_.master();
  use_views();
  state_ = ShardedState::kUnsharded;
}

void GatheredParams::unalias() {
  if (!aliases_master_) return;
  aliases_master_ = false;
  unsharded_ = at::empty({layout_.padded_numel()}, layout_.compute_options());
  use_views();
  buffers::set_storage_alive(unsharded_, false);
  use_guards();
  state_ = ShardedState::kSharded;
}

// The gathered stored forms, rank by rank, decoded into the compute-dtype buffer.
void GatheredParams::decode_gathered() {
  Tracer::Scope span(residency_.tracer(), "fsdp::decode", "compute", layout_.config().tag);
  const int N = layout_.shard_group().size();
  const int64_t per_rank = stored_parts_.numel() / N, S = layout_.shard_numel();
  for (int r = 0; r < N; ++r) {
    stored_.decode(stored_parts_.narrow(0, r * per_rank, per_rank), unsharded_.narrow(0, r * S, S));
  }
  // Note [Resharding to a group]: the part kept after forward is cut from the stored form.
  if (post_forward_group_ == nullptr) stored_parts_ = at::Tensor();
}

bool GatheredParams::holds_current() const {
  return pending_ || (state_ == ShardedState::kUnsharded &&
                      (aliases_master_ || gathered_version_ == master_version_.load(std::memory_order_relaxed)));
}

void GatheredParams::unshard(offload::KeepMaster keep) {
  // Note [Kept gathers]: a gather kept since before an optimizer step holds old values.
  const uint64_t version = master_version_.load(std::memory_order_relaxed);
  if (state_ == ShardedState::kUnsharded && !aliases_master_ && gathered_version_ != version) reshard();
  if (aliases_master_ || state_ == ShardedState::kUnsharded || pending_) return;
  if (post_forward_part_.defined()) {
    if (gathered_version_ == version) return gather_in_group();
    post_forward_part_ = at::Tensor();  // stale: gathered anew from the master
  }
  gathered_version_ = version;
  buffers::set_storage_alive(unsharded_, true);
  input_ = residency_.gather_input(keep);
  const bool decode = stored_.decodes_to(layout_.config().compute_dtype);
  Communicator& group = layout_.shard_group();
  if (group.size() == 1) {
    if (decode) {
      stored_.decode(input_, unsharded_);
    } else {
      unsharded_.copy_(input_);
    }
    input_ = at::Tensor();
    residency_.gather_done();
    state_ = ShardedState::kUnsharded;
    use_views();
    return;
  }
  if (decode) stored_parts_ = at::empty({input_.numel() * group.size()}, input_.options());  // each rank decodes
  handle_ = group.all_gather(decode ? stored_parts_ : unsharded_, input_, layout_.config().tag);
  pending_ = true;
}

void GatheredParams::shadow_gather() {
  Communicator& group = layout_.shard_group();
  if (aliases_master_ || group.size() == 1) return;  // unshard() would run no collective either
  wait();                                            // one gather of this flat param at a time on this rank
  at::Tensor input = residency_.gather_input(offload::KeepMaster::kNo);
  at::Tensor out = at::empty({input.numel() * group.size()}, input.options());
  group.all_gather(out, input, layout_.config().tag).wait();
  residency_.gather_done();
}

void GatheredParams::wait() {
  if (!pending_) return;
  pending_ = false;
  handle_.wait();
  handle_ = CommHandle();
  input_ = at::Tensor();
  if (stored_parts_.defined()) decode_gathered();
  if (!in_group_) residency_.gather_done();
  in_group_ = false;
  state_ = ShardedState::kUnsharded;
  use_views();
}

void GatheredParams::reshard() {
  if (aliases_master_) return;
  wait();  // never free memory a collective is still writing
  post_forward_part_ = at::Tensor();
  stored_parts_ = at::Tensor();
  buffers::set_storage_alive(unsharded_, false);
  use_guards();
  state_ = ShardedState::kSharded;
}

void GatheredParams::reshard_to_group() {
  wait();
  if (post_forward_group_ == nullptr || aliases_master_ || state_ != ShardedState::kUnsharded) return reshard();
  // A stored form (int8, NF4) keeps its part as gathered: the group moves those bytes and decodes them.
  const at::Tensor& from = stored_parts_.defined() ? stored_parts_ : unsharded_;
  const int64_t part = from.numel() / post_forward_group_->size();
  at::Tensor kept = from.narrow(0, part * post_forward_group_->rank(), part).clone();
  reshard();
  post_forward_part_ = std::move(kept);
}

// The gathered params again from the parts the post-forward group's ranks kept (compute dtype, or
// the stored form, decoded once gathered): no master read.
void GatheredParams::gather_in_group() {
  buffers::set_storage_alive(unsharded_, true);
  input_ = std::move(post_forward_part_);
  post_forward_part_ = at::Tensor();
  const bool stored = input_.scalar_type() != layout_.config().compute_dtype;  // the stored form's bytes
  if (stored) stored_parts_ = at::empty({input_.numel() * post_forward_group_->size()}, input_.options());
  handle_ = post_forward_group_->all_gather(stored ? stored_parts_ : unsharded_, input_, layout_.config().tag);
  pending_ = true;
  in_group_ = true;
}

// The master was written outside a step (a load): a gather kept since the last forward (the root
// keeps its params until its backward) holds the old values; it goes, the next use gathers anew.
void GatheredParams::drop_stale() {
  post_forward_part_ = at::Tensor();
  if (aliases_master_) return alias_master();  // a load may have replaced the stored form
  if (state_ == ShardedState::kUnsharded || pending_) reshard();
}

int64_t GatheredParams::bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  // A stored form kept beside the gathered buffer for its part (Note [Resharding to a group]) counts too.
  return aliases_master_ ? 0
                         : static_cast<int64_t>(unsharded_.storage().nbytes()) + bytes(post_forward_part_) +
                               (post_forward_group_ != nullptr ? bytes(stored_parts_) : 0);
}

}  // namespace fsdp
