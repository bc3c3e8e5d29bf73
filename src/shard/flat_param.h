// FlatParam: the parameters of one unit that share (dtype, requires_grad, optimizer group),
// concatenated in registration order into one flat buffer padded to a multiple of the shard group
// size. Rank r of the shard group owns elements [r*S, (r+1)*S) as an fp32 master shard.
//
// Note [Flat buffer lifetime]
// The unsharded buffer is allocated once. Each parameter is a leaf whose data is a view of it
// (Tensor::set_data keeps the parameter's identity, hooks and autograd metadata). Resharding frees
// the memory by resizing the buffer's storage to zero bytes; unsharding grows it back and
// all-gathers into it. Views see the new memory because they share the storage object (so do
// views autograd saved for backward). While resharded, parameter data must not be read: the
// parameters point at guards instead (Note [Guarded parameters], param_data.h), and back at
// their views once the gather lands. Gradients are views of an
// unsharded gradient buffer managed the same way, assigned before the unit's backward so that
// AccumulateGrad adds into them in place, and reduce-scattered without a copy.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "fsdp/comm.h"
#include "fsdp/options.h"
#include "shard/grad_cycle.h"

namespace fsdp {

struct ParamGuardInfo;
namespace offload {
struct OffloadPlacement;
class Residency;
enum class KeepMaster : int;
struct StateTiers;
}  // namespace offload
using offload::KeepMaster;
using offload::OffloadPlacement;
using offload::Residency;

// One parameter's place in a flat buffer. The layout that checkpoints use.
struct FlatParamEntry {
  std::string name;                  // relative to the unit's module, e.g. "mlp.up_proj.weight"
  std::vector<std::string> aliases;  // other names of the same tensor (tied weights)
  at::Tensor param;                  // the user's parameter (identity preserved)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in the flat (unpadded) buffer
};

struct FlatParamConfig {
  at::ScalarType compute_dtype = at::kFloat;  // dtype of the unsharded buffer (param_dtype)
  at::ScalarType reduce_dtype = at::kFloat;   // dtype gradients are reduced in
  bool requires_grad = true;
  // A frozen flat param's stored form (Note [Frozen storage], kernels/cpu/blocks.cpp): kFloat32 is an
  // fp32 master like a trainable one's; anything else is kept as stored, with no fp32 master.
  FrozenStorage storage = FrozenStorage::kFloat32;
  int group = 0;            // optimizer group
  std::string tag;          // "layers.0/0": shows in collective errors
  std::string module_type;  // the unit's module type, for misuse errors (Note [Guarded parameters])
  // The compute device (the process group's, InitOptions::device): where gathered params and
  // their gradients live, and the master shard unless offloaded. Parameters must already be on
  // it, or on the meta device (deferred init materialises the shard on it).
  c10::Device device = c10::Device(c10::kCPU);
  // FullyShardOptions::replicate_params: whole on every rank (a one-rank shard group), its
  // gradient's all-reduce issued as soon as backward is done with it.
  bool replicated = false;
};

enum class ShardedState { kSharded, kUnsharded };

class FlatParam {
  friend class GradCycle;  // the gradient cycle reads the layout, groups and residency

 public:
  // Lays out `entries` and builds this rank's master shard from the parameters' current values;
  // parameters on the meta device wait for materialize().
  FlatParam(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
            Communicator& replicate_group);

  // Deferred init: fills the master shard from `init`. Names passed are `prefix + entry.name`.
  // With `load_writes` (a load that writes every element follows: Note [Deferred init leaves what
  // a load writes] in unit_init.cpp) nothing is written: the values wait for that load, whose
  // master_written() or store_frozen() ends the wait; a later call without it fills them.
  void materialize(const ParamInitFn& init, const std::string& prefix, bool load_writes = false);
  bool awaits_load() const { return awaits_load_; }
  bool needs_materialize() const { return needs_materialize_; }  // meta: deferred init or a load fills it

  // Moves the sharded states to their tiers (before materialize(), so deferred init writes
  // straight into them). Called once, by the root's lazy init.
  void set_offload(OffloadPlacement placement);
  // Where the sharded states live and how they move (offload/residency.h): the one owner of that.
  const Residency& residency() const { return *residency_; }
  const OffloadPlacement& offload() const;
  // A zero-filled tensor of `dtype` (fp32, or bf16 in RAM or the host tier) shaped like the master
  // shard, in the optimizer state's tier.
  at::Tensor new_state_tensor(const std::string& what, at::ScalarType dtype = at::kFloat);
  // Note [The master follows the optimizer state]: optimizer state offloaded, params and grads
  // not. The fp32 master then lives with the state (host or disk tier) and the compute device
  // keeps a working copy of the shard in param_dtype, which the all-gather reads.
  bool master_follows_state() const;
  offload::StateTiers state_tiers() const;  // each state's tier (Note [Placement rules])
  const at::Tensor& working_shard() const;

  // ---- a frozen param kept in a stored form (config().storage, not fp32)
  bool stores_frozen() const { return stored_; }
  // This rank's shard as fp32 values, decoded into `out` (shard_numel(), on the param's device),
  // for a checkpoint to save.
  void frozen_values_into(const at::Tensor& out) const;
  // Replaces the shard's values with `values` (fp32, shard_numel()), stored again (a load).
  void store_frozen(const at::Tensor& values);
  // A load that writes every value of the shard may store it range by range instead, with no fp32
  // copy of the shard: elements [begin, ...) from `values` (any floating dtype, on the host;
  // `begin` starts a block, and a last block they end inside is the parameter's, zeros after
  // them). end_store_values() then ends the load (store_frozen's role).
  void store_values(int64_t begin, const at::Tensor& values);
  bool values_stored() const { return values_stored_; }
  void end_store_values();
  // Bytes of the stored shard.
  // Elements of this rank's shard that hold parameters (the rest is the flat buffer's padding).
  int64_t values_in_shard() const { return std::clamp<int64_t>(numel_ - shard_offset_, 0, shard_numel_); }
  int64_t stored_bytes() const;

  // ---- the optimizer's side (through shard/grad_shards.h)
  // Collects the gradient and returns what the optimizer reads: the gradient shard, or its host
  // copy (through pinned staging on a device) when the master follows the state. Undefined when
  // the flat param has no gradient yet.
  at::Tensor optimizer_grad();
  // Null, or what brings the working copy up to date after the optimizer updated elements
  // [a, b) of the master (their new values in `updated`, host memory).
  std::function<void(int64_t a, int64_t b, const at::Tensor& updated)> after_optimizer_update();
  // The master was written outside the optimizer (a checkpoint load): refresh what derives from it.
  void master_written();
  // A load wrote elements [begin, ...) of the master shard with `values` (fp32 host values), before
  // its master_written(): what derives from them is made from these (Residency::values_written).
  void values_written(int64_t begin, const at::Tensor& values);
  // Disk tier: starts reading the master shard for the next all-gather (Note [Disk tier I/O
  // threads]); the gather uses it unless the master changed since.
  void read_ahead();
  // The master's values a gather kept for the step (see unshard), handed over once; undefined
  // when none was kept or the master was written since.
  at::Tensor take_master_for_step();

  // ---- layout
  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  const FlatParamConfig& config() const { return config_; }
  void set_tag(std::string tag);
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shard_offset() const { return shard_offset_; }  // first flat element of this rank's shard

  Communicator& shard_group() const { return shard_group_; }
  Communicator& replicate_group() const { return replicate_group_; }

  // ---- state
  ShardedState state() const { return state_; }
  at::Tensor& sharded_param();                           // fp32 master shard
  at::Tensor& sharded_grad() { return grads_.shard(); }  // fp32, undefined until the first reduce

  // Issues the all-gather (returns at once); wait_for_unshard() makes the params usable.
  // `keep` (offload/residency.h): what becomes of a disk-tier master read for this gather (Note
  // [Kept master reads] in sharded_unit.cpp). A master kept earlier and not written since is
  // used instead of a read.
  void unshard(KeepMaster keep);
  void unshard();
  ~FlatParam();
  void wait_for_unshard();
  void reshard();
  // Note [Resharding to a group] (sharded_unit.cpp): where a reshard after forward keeps this
  // rank's part of the gathered params (null: nowhere, reshard() frees them all).
  void set_post_forward_group(Communicator* group) { post_forward_group_ = group; }
  // Reshards after forward: with a post-forward group, keeps this rank's 1/group of the gathered
  // params, which the next unshard() gathers within the group (if the master has not changed since).
  void reshard_to_group();
  bool gathering() const { return gather_pending_; }
  // Calls `fn` with this rank's shard, shard_numel() elements read from its tier, for computing on
  // the shard instead of gathering it (a vocab-parallel table, fsdp/vocab_parallel.h): in its
  // floating stored dtype (fp32, bf16, fp16: the caller casts what it uses, a part at a time), or
  // decoded whole into the compute dtype from int8 or NF4 blocks.
  void with_shard_values(const std::function<void(const at::Tensor&)>& fn);
  // Takes part in another rank's all-gather of this flat param (Note [Join rounds], join.cpp): sends
  // this rank's shard, as unshard() would, and drops what arrives; the params stay as they are.
  void shadow_gather();

  // The gradient cycle (shard/grad_cycle.h). Before the unit's backward: the gradient buffer
  // exists and params' .grad are views of it, after collecting a reduction still in flight (Note
  // [Lazy gradient collection]).
  void prepare_gradients() { grads_.prepare(); }
  bool gradients_prepared() const { return grads_.prepared(); }
  // AccumulateGrad is done with entry k's gradient (Note [The first gradient is copied]).
  void gradient_landed(size_t k) { grads_.landed(k); }
  // Note [Guarded gradients] (param_data.h): after a backward the parameters' .grad are guards;
  // unguard_grads(), at the root's next forward, points them back at the gradient buffer while
  // gradients accumulate (no sync), else leaves them undefined.
  void guard_grads() { grads_.guard(); }
  void unguard_grads() { grads_.unguard(); }
  // Issues the reduction of the gradient buffer (reduce-scatter over the shard group).
  void reduce_scatter_grads() { grads_.reduce_scatter(); }
  // FSDPModule::set_requires_all_reduce: read when the reduce-scatter is issued.
  void set_requires_all_reduce(bool on) { requires_all_reduce_ = on; }
  bool requires_all_reduce() const { return requires_all_reduce_; }
  // Gradient sums reduce-scattered but not yet all-reduced across the replicas, and their bytes.
  bool holds_partial_grads() const { return grads_.holds_partial(); }
  bool grads_reduced_since_zero() const { return grads_.reduced_since_zero(); }
  int64_t partial_grad_bytes() const { return grads_.partial_bytes(); }
  void flush_partial_grads() { grads_.flush_partial(); }
  // UsageError when partial sums wait for an all-reduce that never came, naming `what` read them.
  void check_no_partial_grads(const std::string& what) const;
  // An optimizer is about to step the master: a gather kept from before is stale from now on.
  void master_will_change() { master_version_.fetch_add(1, std::memory_order_relaxed); }
  // Gathered (or gathering) from the master's current values: what a prefetch need not redo.
  bool holds_current_gather() const {
    return gather_pending_ ||
           (state_ == ShardedState::kUnsharded &&
            (aliases_master_ || gathered_version_ == master_version_.load(std::memory_order_relaxed)));
  }
  // Waits for the reduction, all-reduces across replicas when hybrid, and adds the result to the
  // fp32 gradient shard, then frees the gradient buffer.
  void finalize_grads() { grads_.finalize(); }
  // Drops this rank's gradient shard values to zero (keeps the buffer).
  void zero_grad() { grads_.zero(); }

  // Bytes currently held.
  int64_t unsharded_bytes() const;
  int64_t unsharded_grad_bytes() const { return grads_.buffer_bytes(); }

 private:
  at::Tensor build_master(bool meta) const;
  void decode_gathered();
  void gather_in_group();  // Note [Resharding to a group]
  void drop_stale_gather();
  void use_unsharded_views();
  void alias_master();
  void loaded();
  void make_guards();
  void use_guards();  // while sharded: see Note [Guarded parameters] in param_data.h

  std::vector<FlatParamEntry> entries_;
  FlatParamConfig config_;
  Communicator& shard_group_;
  bool requires_all_reduce_ = true;
  Communicator& replicate_group_;
  int64_t numel_ = 0, padded_numel_ = 0, shard_numel_ = 0, shard_offset_ = 0;
  bool needs_materialize_ = false;
  bool awaits_load_ = false;  // materialize(.., load_writes): a load writes the values
  // The unsharded buffer is the shard itself: one rank per shard, kept in the compute dtype.
  bool aliases_master_ = false;
  // Frozen, kept in config_.storage (the master is the stored form); a gather that needs decoding
  // lands in gathered_stored_ first.
  bool stored_ = false;
  bool needs_encode_ = false;   // deferred init: the master is fp32 values until materialize() ends
  bool values_stored_ = false;  // store_values() since the last end_store_values()
  at::Tensor gathered_stored_;

  ShardedState state_ = ShardedState::kSharded;
  std::unique_ptr<Residency> residency_;  // the master shard and where every state lives
  at::Tensor unsharded_;                  // [padded] compute dtype; storage freed while sharded
  at::Tensor gather_input_;               // the shard in compute dtype, kept alive during the all-gather
  CommHandle gather_handle_;
  bool gather_pending_ = false;
  // Note [Kept gathers] (sharded_unit.cpp): bumped when an optimizer takes the gradient to step the
  // master (on the optimizer's thread with the step in backward); a kept gather older than it is
  // gathered again.
  std::atomic<uint64_t> master_version_{0};
  uint64_t gathered_version_ = 0;
  // Note [Resharding to a group]: the group, the part kept (compute dtype; undefined when none),
  // and whether the gather in flight is the group's (it read no master: no gather_done).
  Communicator* post_forward_group_ = nullptr;
  at::Tensor post_forward_part_;
  bool part_stored_ = false;  // the part is in the stored form (a frozen int8 / NF4 flat param)
  bool gathering_in_group_ = false;

  GradCycle grads_{*this};

  std::shared_ptr<ParamGuardInfo> guard_info_;
  std::vector<at::Tensor> guards_;  // per entry
};

}  // namespace fsdp
