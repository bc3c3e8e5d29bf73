// GatheredParams: one flat param's unsharded buffer and the cycle around it (Note [Flat buffer
// lifetime], flat_param.h): the all-gather that fills it from every rank's shard (decoding a
// stored form), the parameters pointed at its views while it is gathered and at guards while it is
// not (Note [Guarded parameters], param_data.h), a gather kept across an optimizer step checked
// by version (Note [Kept gathers], sharded_unit.cpp), and the part kept after forward for a gather
// within a smaller group (Note [Resharding to a group], sharded_unit.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flat/flat_layout.h"
#include "fsdp/comm.h"

namespace fsdp {

struct ParamGuardInfo;
class StoredShard;
namespace offload {
class Residency;
enum class KeepMaster : int;
}  // namespace offload

enum class ShardedState { kSharded, kUnsharded };

class GatheredParams {
 public:
  // Points the parameters at views of the buffer (the shard itself when it is the gathered buffer:
  // one rank, kept in the compute dtype), else at guards.
  GatheredParams(FlatLayout& layout, offload::Residency& residency, const StoredShard& stored);
  ~GatheredParams();

  ShardedState state() const { return state_; }
  bool pending() const { return pending_; }  // an all-gather in flight
  // The unsharded buffer is the master shard (or its working copy): nothing to gather or free.
  bool aliases_master() const { return aliases_master_; }
  const std::shared_ptr<ParamGuardInfo>& guard_info() const { return guard_info_; }

  // Issues the all-gather (returns at once); wait() makes the params usable. `keep`: what becomes
  // of a disk-tier master read for it (offload/residency.h).
  void unshard(offload::KeepMaster keep);
  void wait();
  void reshard();
  void set_post_forward_group(Communicator* group) { post_forward_group_ = group; }
  // Reshards after forward, keeping this rank's 1/group of the gathered params with a post-forward
  // group (which the next unshard() gathers within the group if the master has not changed since).
  void reshard_to_group();
  // Takes part in another rank's all-gather (Note [Join rounds], join.cpp): sends this rank's
  // shard and drops what arrives; the params stay as they are.
  void shadow_gather();
  // An optimizer is about to step the master: a gather kept from before is stale from now on.
  void master_will_change() { master_version_.fetch_add(1, std::memory_order_relaxed); }
  // Gathered (or gathering) from the master's current values: what a prefetch need not redo.
  bool holds_current() const;
  bool holds_part() const { return post_forward_part_.defined(); }
  // The master was written outside a step (a load): a kept gather or part goes.
  void drop_stale();
  // The params as views of the shard when it is the gathered buffer (after deferred init, or a
  // move of the master): no-op otherwise.
  void alias_master();
  // The params get a buffer of their own (the master was offloaded).
  void unalias();
  int64_t bytes() const;  // held now: the buffer while gathered, a kept part

 private:
  void decode_gathered();
  void gather_in_group();
  void use_views();
  void use_guards();

  FlatLayout& layout_;
  offload::Residency& residency_;
  const StoredShard& stored_;
  ShardedState state_ = ShardedState::kSharded;
  bool aliases_master_ = false;
  at::Tensor unsharded_;     // [padded] compute dtype; storage freed while sharded
  at::Tensor input_;         // the shard as sent, kept alive during the all-gather
  at::Tensor stored_parts_;  // every rank's stored form as gathered, before it is decoded
  CommHandle handle_;
  bool pending_ = false;
  // Note [Kept gathers]: bumped when an optimizer takes the gradient to step the master (on the
  // optimizer's thread with the step in backward); a kept gather older than it is gathered again.
  std::atomic<uint64_t> master_version_{0};
  uint64_t gathered_version_ = 0;
  // Note [Resharding to a group]: the group, the part kept (compute dtype or the stored form;
  // undefined when none), and whether the gather in flight is the group's (it read no master).
  Communicator* post_forward_group_ = nullptr;
  at::Tensor post_forward_part_;
  bool in_group_ = false;
  std::shared_ptr<ParamGuardInfo> guard_info_;
  std::vector<at::Tensor> guards_;  // per entry
};

}  // namespace fsdp
