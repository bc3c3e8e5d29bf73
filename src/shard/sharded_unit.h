// ShardedUnit: the state machine of one fully_shard call — its flat params, the forward and
// backward hooks, and, on the root unit, the per-step state shared by every unit under it.
//
//   forward:   pre_forward (unshard, wait) -> module forward -> post_forward (reshard if asked)
//              outputs carry a hook that runs pre_backward.
//   backward:  pre_backward (unshard, wait, gradient views ready; the first one queues the
//              root's end-of-backward callback) -> AccumulateGrad post-hooks count each flat
//              param's gradients; when all have landed: reduce-scatter (async) and reshard ->
//              finalize_backward on the root: issue the reductions that did not start (unused
//              params), check collective identities where the transport cannot, reshard
//              everything, reset; it waits for no reduction (Note [Lazy gradient collection]).
// Every transition is idempotent: a unit used twice in a forward, used by a recomputation
// inside backward, or not used at all in a step goes through the same code.
//
// Where its methods are defined, by concern: sharded_unit.cpp (the forward and backward state
// machine above, prefetch and kept master reads, the collective check), unit_init.cpp
// (construction, the gradient hooks, the root's lazy init and offload placement), unit_options.cpp
// (options resolved against the mesh and inherited from the root; the resharding rule the planner
// applies too in reshard_rules.cpp), unit_params.cpp (parameter
// discovery, flat params, a vocab-parallel table's checks), tied_params.cpp (parameters owned by a
// unit, ties across units, paths for errors), buffers.cpp (the model's buffers), join.cpp
// (fsdp::Join's rounds). The public API over it (fully_shard, FSDPModule, UnshardHandle,
// fsdp::call's scope) is fully_shard.cpp.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/device_mesh.h"
#include "fsdp/fully_shard.h"
#include "fsdp/options.h"
#include "prefetch/execution_order.h"
#include "prefetch/keep_params.h"
#include "prefetch/policy.h"
#include "flat/flat_param.h"
#include "shard/post_reduce_hook.h"
#include "shard/resolved_options.h"

namespace torch::autograd {
struct Node;
}

namespace fsdp::offload {
class DiskTier;
class DeviceStager;
}  // namespace fsdp::offload

namespace fsdp {

class ShardedUnit;
class Tracer;

enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

// A persistent buffer of the model (FullyShardOptions::buffers): the live tensor, its name relative
// to the root, and the dtype checkpoints hold it in (its dtype before any buffer_dtype cast).
struct BufferState {
  std::string name;
  at::Tensor tensor;
  at::ScalarType saved_dtype = at::kFloat;
};

// Per-step state that only the root unit holds.
struct RootState {
  std::vector<ShardedUnit*> units;  // every unit under the root, root first (pre-order)
  bool callback_queued = false;
  bool in_backward = false;
  std::vector<FlatParam*> pending_reduces;  // reduce-scatters issued and not yet collected
  // The groups whose collective identities are checked in their queue (none on the CPU
  // transports), found at the first end of backward: ShardedUnit::verify_collectives.
  std::optional<std::vector<Communicator*>> queue_checked_groups;
  prefetch::ExecutionOrder order;  // of indices into `units`
  bool step_trains = false;        // the root's forward of this step ran with gradients on
  std::shared_ptr<Tracer> tracer;
  // Peak bytes of unsharded param and gradient buffers alive at once (see memory.h).
  int64_t peak_unsharded_bytes = 0;
  int peak_gathered_units = 0;  // units with params gathered or gathering at once, at most
  // Offload: one disk tier and one stager per rank, shared by every unit (null when unused).
  std::shared_ptr<offload::DiskTier> disk_tier;
  std::shared_ptr<offload::DeviceStager> stager;
  // Persistent buffers of the whole tree (buffers.cpp) and how they are kept consistent.
  std::vector<BufferState> buffers;
  BufferSync buffer_sync = BufferSync::kBroadcast;
  // The optimizer's, or null (shard/post_reduce_hook.h; GradShards::install_hook).
  PostReduceHook* post_reduce_hook = nullptr;
  bool recomputed = false;     // a forward ran inside this backward (activation checkpointing)
  bool buffers_dirty = false;  // a training forward ran since the buffers were last synchronised
  bool joined = false;         // inside an fsdp::Join (Note [Join rounds], join.cpp)

  // The units of a recorded order (indices into `units`).
  std::vector<ShardedUnit*> units_in(const std::vector<prefetch::UnitIndex>& order) const {
    std::vector<ShardedUnit*> out;
    for (prefetch::UnitIndex i : order) out.push_back(units[i]);
    return out;
  }
};

class ShardedUnit : public std::enable_shared_from_this<ShardedUnit> {
 public:
  ShardedUnit(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& mesh, FullyShardOptions options);
  ~ShardedUnit();

  // Groups the module's parameters (those not owned by nested units) into flat params.
  void build();

  // ---- names and tree
  const std::string& prefix() const { return prefix_; }  // "model.layers.0." relative to the root
  std::string name() const;                              // for errors: "model.layers.0" or "<root>"
  bool is_root() const { return root_ == this; }
  // A unit a larger unit was applied over (its parent, sharded after it): only a root's forward
  // may start a step, so running it before its root is refused.
  // `enclosing`: the unit applied over it; `path`: this unit's module path in that unit's module.
  void mark_nested(std::weak_ptr<ShardedUnit> enclosing, std::string path) {
    nested_ = true;
    enclosing_ = std::move(enclosing);
    path_in_enclosing_ = std::move(path);
  }
  // The module's path from the outermost sharded module around it ("layers.0"; "<root>" for that
  // module itself): name() before the root's lazy init, for errors.
  std::string path_before_root() const;
  ShardedUnit* root() { return root_; }
  RootState& root_state() { return *root_->root_state_; }
  // Makes this unit the root of every unit in its module tree (names, inherited options, offload
  // placement, deferred init). `load_writes`: null, or the parameters (full names) a load that
  // follows writes whole; deferred init leaves a flat param all of whose parameters it names to
  // that load (Note [Deferred init leaves what a load writes] in unit_init.cpp).
  void lazy_init(const std::function<bool(const std::string& name)>& load_writes = nullptr);
  // The root: fills every flat param still waiting for a load from its unit's init (a load that
  // failed midway).
  void finish_deferred_init();
  // This unit and every unit nested in its module tree, pre-order.
  std::vector<ShardedUnit*> subtree_units() const;

  // ---- lifecycle (see the file comment)
  void pre_forward();
  void post_forward();
  void pre_backward();
  // fsdp::call's inputs: with frozen params, an input that requires grad is tracked until its
  // gradient is computed (Note [When a unit's backward ends]).
  at::Tensor track_input(const at::Tensor& t);
  void finalize_backward();  // root only: the end-of-backward callback
  void unshard();
  void wait_for_unshard();
  void reshard();
  // After forward: reshard, or keep a group's shard (Note [Resharding to a group]).
  void reshard_to_group();
  bool is_gathered_or_gathering() const;
  // Its index in the root's unit list (RootState::units): how the prefetch layer names it.
  prefetch::UnitIndex index() const { return index_; }
  // What prefetch::keeps_params_after_forward decides from, for this unit: `ran_last`, it ran
  // forward last (ExecutionOrder::ran_last); `backward_follows`, gradients are on in its forward;
  // `recomputing`, its forward runs inside backward.
  prefetch::ForwardEnd forward_end(bool ran_last, bool backward_follows, bool recomputing) const;
  // Whether the unit gathers again from its masters in backward in a training step like the last
  // one (its forward with gradients on or off as then; `ran_last`: it runs forward last), by the
  // same rule; a unit resharded to a group gathers its parts instead (Note [Resharding to a group]).
  bool gathers_in_backward(bool ran_last) const;
  // Whether its forward ran with gradients on in the last training step (true before any): off
  // under activation checkpointing, whose recomputation gathers it again in backward.
  bool forward_had_grad() const { return forward_had_grad_; }
  TrainingState training_state() const { return state_; }
  // An output of this step's forwards required grad (fsdp::call hooked it), or a forward ran without
  // gradients (an activation checkpoint's, recomputed in backward): its backward may run. False for
  // a unit whose forward took no input and no param that requires grad (a frozen embedding): the
  // backward's prefetch passes it by.
  bool awaits_backward() const { return awaits_backward_; }
  void output_hooked() { awaits_backward_ = true; }
  // Host bytes a read of this unit's disk-tier masters takes (0 without any).
  int64_t disk_master_bytes() const;
  // Explicit prefetch lists; when set they replace the recorded-order ones.
  void set_forward_prefetch(std::vector<ShardedUnit*> units) { forward_prefetch_ = std::move(units); }
  void set_backward_prefetch(std::vector<ShardedUnit*> units) { backward_prefetch_ = std::move(units); }
  // Whether an optimizer steps this unit's tree in backward (applies_gradients of the root's
  // post_reduce_hook).
  bool steps_in_backward() const;
  // Collects every gradient reduction still in flight (see Note [Lazy gradient collection]).
  void collect_gradients();
  Tracer* tracer() { return root_ ? root_state().tracer.get() : nullptr; }

  // ---- parts
  std::vector<std::unique_ptr<FlatParam>>& flat_params() { return flat_params_; }
  const ResolvedOptions& options() const { return options_; }
  DeviceMesh& mesh() { return mesh_; }
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }
  // FSDPModule::set_reshard_after_forward / _backward (Note [Kept gathers] in sharded_unit.cpp).
  void set_reshard_after_forward(bool reshard) {
    options_.reshard_after_forward = reshard;
    options_.reshard_after_forward_explicit = true;
  }
  void set_reshard_after_backward(bool reshard) { reshard_after_backward_ = reshard; }
  std::weak_ptr<torch::nn::Module> module() const { return module_; }
  bool nested() const { return nested_; }

  // ---- join.cpp: Note [Join rounds]
  // Before this unit's own gather inside a Join: agrees with the other ranks, taking part in
  // theirs first. A no-op outside a Join or when the unit is already gathered.
  void join_round();
  void join_reduce_round();      // root only: the end of a backward inside a Join
  void join_finish();            // root only: this rank is done (Join::finish)
  void set_joined(bool joined);  // root only

 private:
  static void verify_collectives(RootState& rs);  // before any optimizer step: sharded_unit.cpp
  // tied_params.cpp: Note [Tied parameters across units]
  struct TiedParam {
    std::string name;                  // in this unit's module
    std::weak_ptr<ShardedUnit> owner;  // the unit that holds it
    std::string owner_name;            // in the owner's module
  };
  // Whether `param` (named `name` here) is tied to a parameter another unit holds: either a unit
  // nested in this one (`nested_owner`, else null) or one sharded earlier beside this one; then
  // it is recorded in tied_ (and left out of this unit) for the root's lazy init to refuse.
  bool record_tie(const std::string& name, const at::Tensor& param, ShardedUnit* nested_owner);
  void check_no_ties() const;      // root only, first in lazy_init
  void check_vocab_table() const;  // unit_init.cpp: FullyShardOptions::vocab_parallel's requirements
  // unit_init.cpp
  void check_not_owned(const std::string& name, const at::Tensor& param) const;  // Note [Parameters already sharded]
  void record_owned();
  void forget_owned();
  void make_flat_params(const torch::nn::Module& module);
  void register_grad_hooks();
  void resolve_inherited_options();  // root only, in lazy_init
  void open_offload_tiers();         // root only, in lazy_init
  void place_offloaded_states();     // root only, in lazy_init
  // buffers.cpp: root only. init_buffers (in lazy_init) collects the persistent buffers, casts
  // them, checks that every rank has the same ones and synchronises them once; sync_buffers
  // applies the BufferSync policy (at the end of backward, or at the next root forward when a
  // training forward had no backward).
  void init_buffers();
  void sync_buffers();
  // sharded_unit.cpp
  void on_grad_ready(size_t flat_index, size_t entry);
  // An explicit prefetch list as indices in the root's unit list (units of other roots left out);
  // none when the list is empty (the recorded order decides).
  prefetch::ExplicitTargets explicit_targets(const std::vector<ShardedUnit*>& units) const;
  prefetch::Limits prefetch_limits() const;
  void post_backward(size_t flat_index);
  void maybe_end_backward();  // Note [When a unit's backward ends]
  void note_memory();
  void reset_after_backward();
  void choose_kept_masters();  // root only, at the start of a step: Note [Kept master reads]

  std::weak_ptr<torch::nn::Module> module_;
  DeviceMesh mesh_;
  // What the user passed; read only to resolve options_ (at fully_shard and the root's lazy init).
  FullyShardOptions requested_;
  ResolvedOptions options_;
  bool requires_gradient_sync_ = true;
  bool reshard_after_backward_ = true;
  Communicator* shard_group_ = nullptr;
  Communicator* replicate_group_ = nullptr;
  std::shared_ptr<Communicator> no_shard_group_;  // kNoShard, or replicate_params: a one-rank shard group
  // Note [Resharding to a group]: where backward gathers after a forward resharded to a group; null: none.
  Communicator* post_forward_group_ = nullptr;

  std::vector<std::unique_ptr<FlatParam>> flat_params_;
  std::vector<size_t> grads_landed_;      // per flat param, this backward
  std::vector<bool> post_backward_done_;  // per flat param, this backward
  bool has_frozen_ = false;
  // Inputs of this step's forwards that require grad, and those whose gradient is still to come
  // (Note [When a unit's backward ends]).
  int inputs_seen_ = 0, inputs_pending_ = 0;
  bool awaits_backward_ = false;  // awaits_backward(); cleared at the end of each backward
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;  // kept alive for the hooks

  // The dtype each buffer this unit casts had before the cast (what checkpoints hold).
  std::unordered_map<const void*, at::ScalarType> buffer_dtypes_;

  std::vector<ShardedUnit*> forward_prefetch_, backward_prefetch_;
  bool keep_forward_master_ = false;  // Note [Kept master reads]
  bool forward_had_grad_ = true;      // see forward_had_grad()
  std::chrono::steady_clock::time_point forward_begin_, backward_begin_;

  std::string prefix_;
  bool nested_ = false;
  std::weak_ptr<ShardedUnit> enclosing_;
  std::string path_in_enclosing_;
  std::vector<TiedParam> tied_;
  ShardedUnit* root_ = nullptr;
  prefetch::UnitIndex index_ = 0;  // in root_'s RootState::units
  std::unique_ptr<RootState> root_state_;
  TrainingState state_ = TrainingState::kIdle;
};

// ---- the units behind public handles (FSDPModule keeps its unit opaque)

namespace detail {
// The child a sharded module gets (unit_init.cpp's UnitAnchor): how fsdp::call finds its unit.
inline constexpr const char* kUnitAnchorName = "_fsdp_unit";
struct FSDPModuleAccess {
  static std::shared_ptr<FSDPModule> make(std::shared_ptr<ShardedUnit> unit) {
    return std::shared_ptr<FSDPModule>(new FSDPModule(std::move(unit)));
  }
  static ShardedUnit& unit(const FSDPModule& handle) { return *handle.unit_; }
};
}  // namespace detail

// The unit of a handle fully_shard returned.
inline ShardedUnit& unit_of(const FSDPModule& handle) { return detail::FSDPModuleAccess::unit(handle); }
// The handle's unit and the units nested under it, pre-order (lazy init first when no root has
// claimed them yet).
std::vector<ShardedUnit*> units_of(const FSDPModule& handle);
// Their flat params in that order, each unit's in turn: ShardState::flat_index indexes this.
std::vector<FlatParam*> flat_params_of(const FSDPModule& handle);
// The units of `forward_order` that keep their forward all-gather's read of a disk-tier master for
// their backward gather: the last ones to run forward (the first of backward) that gather again in
// backward, as many as fit in half of `budget_bytes` (Note [Kept master reads]).
std::vector<ShardedUnit*> units_keeping_forward_masters(const std::vector<ShardedUnit*>& forward_order,
                                                        int64_t budget_bytes);

}  // namespace fsdp
