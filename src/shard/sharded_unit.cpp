// ShardedUnit's forward/backward state machine: gathering and freeing, prefetch, the backward
// hooks' bookkeeping and the root's end-of-backward callback. See the state diagram in
// sharded_unit.h; construction and the root's lazy init are in unit_init.cpp.
#include "shard/sharded_unit.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "shard/grad_shards.h"
#include "offload/residency.h"
#include "offload/tier_tensors.h"

namespace fsdp {

std::string ShardedUnit::name() const {
  if (prefix_.empty()) return "<root>";
  return prefix_.substr(0, prefix_.size() - 1);
}

// Note [The step in backward]
// With an optimizer that steps during backward (ShardedOptimizer::step_in_backward), a unit's
// flat params are stepped as soon as their reduced gradients are collected, which is during
// the backward of the unit after it in backward order (post_backward below), on the
// optimizer's own thread, while the training thread goes on with the backward. A disk-tier
// master read for a gather in backward is kept for that step (Note [Kept master reads]), so the
// step reads only the optimizer state, and its writes go out under the rest of the backward.
//
// Note [Kept master reads]
// A disk-tier master is read for each all-gather of its unit: in forward and, unless the unit
// keeps its params, again in backward. Two of those reads are kept in host memory rather than
// read again (KeepMaster, offload/residency.h):
//  - forward: the units whose backward comes first (the last to run forward, among those that
//    gather again in backward) keep their forward read for their backward gather, as many as fit
//    in half of memory_budget_bytes, counted against the budget while kept; chosen at the start of
//    each step from the last step's order, by units_keeping_forward_masters (which offload_plan
//    uses too); a unit whose forward runs without gradients (activation checkpointing) keeps
//    none: its read is kept only under gradients, and its recomputation gathers it in backward;
//  - backward, with the step in backward: the gather's read is kept for the unit's step.
// Every kept read is dropped when a step starts and by any write of the master (a checkpoint load).
bool ShardedUnit::steps_in_backward() const {
  return root_ != nullptr && applies_gradients(root_->root_state_->post_reduce_hook);
}

void ShardedUnit::unshard() {
  using Keep = KeepMaster;
  Keep keep = Keep::kNo;
  if (root_ != nullptr && root_state().in_backward) {
    if (steps_in_backward() && requires_gradient_sync_) keep = Keep::kForStep;
  } else if (keep_forward_master_ && c10::GradMode::is_enabled()) {
    keep = Keep::kForBackward;
  }
  for (auto& fp : flat_params_) fp->unshard(keep);
}

prefetch::ForwardEnd ShardedUnit::forward_end(bool ran_last, bool backward_follows, bool recomputing) const {
  prefetch::ForwardEnd f;
  f.reshard_after_forward = options_.reshard_after_forward;
  f.option_explicit = options_.reshard_after_forward_explicit;
  f.is_root = is_root();
  f.ran_last = ran_last;
  f.backward_follows = backward_follows;
  f.recomputing = recomputing;
  return f;
}

bool ShardedUnit::gathers_in_backward(bool ran_last) const {
  if (post_forward_group_ != nullptr && forward_had_grad_) return false;
  return !prefetch::keeps_params_after_forward(forward_end(ran_last, forward_had_grad_, /*recomputing=*/false));
}

int64_t ShardedUnit::disk_master_bytes() const {
  int64_t bytes = 0;
  for (const auto& fp : flat_params_) {
    if (fp->master_follows_state() || !offload::is_disk_backed(fp->sharded_param())) continue;
    bytes += offload::whole_pages(fp->stored_bytes());  // an fp32 master, or a frozen shard's stored form
  }
  return bytes;
}

std::vector<ShardedUnit*> units_keeping_forward_masters(const std::vector<ShardedUnit*>& forward_order,
                                                        int64_t budget_bytes) {
  // A forward without gradients (activation checkpointing) cannot keep its read for backward.
  std::vector<offload::ForwardRead> reads;
  for (size_t i = 0; i < forward_order.size(); ++i) {
    ShardedUnit* unit = forward_order[i];
    reads.push_back({unit, unit->forward_had_grad(), unit->gathers_in_backward(i + 1 == forward_order.size()),
                     unit->disk_master_bytes()});
  }
  std::vector<ShardedUnit*> out;
  for (const size_t i : offload::units_keeping_forward_reads(reads, budget_bytes)) out.push_back(forward_order[i]);
  return out;
}

void ShardedUnit::choose_kept_masters() {
  RootState& rs = root_state();
  if (!rs.disk_tier) return;  // masters are kept only from the disk tier
  for (ShardedUnit* unit : rs.units) {
    unit->keep_forward_master_ = false;
    for (auto& fp : unit->flat_params_) fp->take_master_for_step();  // dropped
  }
  for (ShardedUnit* unit :
       units_keeping_forward_masters(rs.units_in(rs.order.predicted()), rs.disk_tier->budget_bytes())) {
    unit->keep_forward_master_ = true;
  }
}

void ShardedUnit::wait_for_unshard() {
  for (auto& fp : flat_params_) fp->wait_for_unshard();
  note_memory();
}

void ShardedUnit::reshard() {
  for (auto& fp : flat_params_) fp->reshard();
}

// Note [Resharding to a group]
// FullyShardOptions::reshard_after_forward_group = k (FSDP2's reshard_after_forward as an int,
// ZeRO++'s hpZ). The shard group of N ranks is cut into N/k groups of k consecutive ranks
// (DeviceMesh::shard_subgroup; with ranks numbered node by node, a group is a node's ranks). After
// a forward that a backward will follow, each rank keeps, instead of nothing, the k-th part of the
// gathered flat buffer that its place in the group names (padded_numel / k elements of the compute
// dtype; for a frozen int8 / NF4 flat param, the stored forms of N / k ranks, cut from the gathered
// stored bytes, which are kept beside the decoded buffer through the forward for this), and frees
// the rest. The backward's gather all-gathers those parts within the group (and decodes a stored
// form), which rebuilds the same buffer bit for bit: no master is read and no byte crosses the
// group. The cost is the parts held from forward to backward: 1/k of each unit's gathered bytes
// as they travel (the planner's "parts kept after forward"). A part is dropped by any other
// reshard and when the master it came from changes (the unit then gathers from the master as
// usual); a forward without gradients, a recomputation and a forward inside a Join reshard in full.
void ShardedUnit::reshard_to_group() {
  for (auto& fp : flat_params_) fp->gathered().reshard_to_group();
}

bool ShardedUnit::is_gathered_or_gathering() const {
  for (const auto& fp : flat_params_) {
    if (fp->gathered().holds_current()) return true;  // a stale kept gather is gathered again (Note [Kept gathers])
  }
  return false;
}

// Note [Kept gathers]
// FSDPModule::set_reshard_after_forward(false) keeps a unit's gathered params from its forward to
// its backward; set_reshard_after_backward(false) keeps them after its backward too
// (maybe_end_backward and finalize_backward skip the reshard), so the next micro-batch's forward
// and backward find them gathered and issue no all-gather. Gradients are unaffected: the gradient
// buffer follows the backward as always. A kept gather must not outlive the values it was gathered
// from. Each FlatParam counts the optimizer's takes of its gradient (master_will_change: the step
// is about to write the master) and records the count when it issues a gather; unshard() drops a
// gather whose count is old and gathers again, and a checkpoint load drops it (drop_stale_gather).
// Frozen flat params are never stepped, so their kept gather survives the steps. Prefetching sees
// a stale gather as not gathered. The planner counts the kept units' gathered bytes
// (PlanRequest::keep_gathered).

namespace {

// The root's units as the prefetch layer sees them (prefetch/policy.h).
class RootUnits final : public prefetch::Units {
 public:
  explicit RootUnits(RootState& rs) : rs_(rs) {}
  size_t count() const override { return rs_.units.size(); }
  bool gathered_or_gathering(prefetch::UnitIndex unit) const override {
    return rs_.units[unit]->is_gathered_or_gathering();
  }
  void gather(prefetch::UnitIndex unit) override { rs_.units[unit]->unshard(); }
  void read_ahead(prefetch::UnitIndex unit) override {  // Note [Disk tier I/O threads]
    for (auto& fp : rs_.units[unit]->flat_params()) fp->read_ahead();
  }
  bool backward_done(prefetch::UnitIndex unit) const override {
    const ShardedUnit& u = *rs_.units[unit];
    return rs_.in_backward && (u.training_state() == TrainingState::kPostBackward || !u.awaits_backward());
  }

 private:
  RootState& rs_;
};

}  // namespace

prefetch::ExplicitTargets ShardedUnit::explicit_targets(const std::vector<ShardedUnit*>& units) const {
  if (units.empty()) return std::nullopt;
  std::vector<prefetch::UnitIndex> out;
  for (ShardedUnit* unit : units) {
    if (unit->root_ == root_) out.push_back(unit->index_);
  }
  return out;
}

prefetch::Limits ShardedUnit::prefetch_limits() const {
  prefetch::Limits limits;
  limits.prefetch_depth = options_.prefetch_depth;
  limits.max_unsharded_units = options_.max_unsharded_units;
  limits.read_ahead = root_->root_state_->disk_tier != nullptr;
  return limits;
}

void ShardedUnit::pre_forward() {
  if (options_.vocab_parallel) {
    throw UsageError("fsdp: sharded module '" + path_before_root() +
                     "' is a vocab-parallel table (FullyShardOptions::vocab_parallel), never gathered: "
                     "use it through fsdp::sharded_embedding or fsdp::sharded_cross_entropy, not fsdp::call");
  }
  if (root_ == nullptr) {
    if (nested_) {
      auto module = module_.lock();
      throw UsageError("fsdp: sharded module '" + path_before_root() + "' (" +
                       (module ? module->name() : std::string("?")) +
                       ") ran before its root: the root's forward never ran through fsdp::call. A step starts "
                       "with fsdp::call(root, inputs) on the module fully_shard was applied to last");
    }
    lazy_init();
  }
  RootState& rs = root_state();
  const bool recompute = rs.in_backward;  // activation checkpointing inside backward
  if (!is_root() && !recompute && root_->state_ != TrainingState::kForward) {
    auto module = module_.lock();
    throw UsageError("fsdp: sharded module '" + name() + "' (" + (module ? module->name() : std::string("?")) +
                     ") ran outside its root's forward: the root's forward must run through fsdp::call too "
                     "(fsdp::call(root, inputs)), and this module inside it");
  }
  if (is_root() && !recompute) {
    for (ShardedUnit* unit : rs.units) {
      for (auto& fp : unit->flat_params_) fp->grads().unguard();  // Note [Guarded gradients]
      unit->inputs_pending_ = unit->inputs_seen_ = 0;             // a forward that no backward followed
      unit->awaits_backward_ = false;
    }
    if (!rs.joined) rs.order.begin_step();  // Note [Join rounds]: a Join's forwards are not recorded
    rs.step_trains = c10::GradMode::is_enabled();
    choose_kept_masters();
    if (rs.buffers_dirty && !rs.joined) sync_buffers();  // inside a Join: at Join::finish
  }
  if (!recompute && !rs.joined) rs.order.record(index_);
  if (recompute) rs.recomputed = true;
  // A forward without gradients may be an activation checkpoint's, recomputed in backward: its
  // backward may come, and the prefetch should not pass it by.
  if (!c10::GradMode::is_enabled()) awaits_backward_ = true;
  forward_begin_ = std::chrono::steady_clock::now();
  join_round();
  // Our own gather goes first on the communicator's queue, the prefetches behind it.
  unshard();
  if (!recompute && !rs.joined) {
    RootUnits units(rs);
    prefetch::before_forward(rs.order, index_, explicit_targets(forward_prefetch_), prefetch_limits(), units);
  }
  wait_for_unshard();  // also records the memory peak, prefetched buffers included
  state_ = TrainingState::kForward;
}

// Note [The last unit keeps its params]
// The unit that runs forward last runs backward first (right after the root's own backward, which
// keeps its params too): resharding it after forward only to gather it again at once costs one
// all-gather per step and a wait at the start of backward that nothing overlaps. So, unless
// reshard_after_forward is set explicitly, a unit keeps its params after forward when it was the
// last to run forward in the previous step and as many units ran before it this step as then
// (the order looks the same), and gradients are on (a backward is coming; a block under activation
// checkpointing runs its forward without them, and its recomputation gathers it again). The rule
// is prefetch::keeps_params_after_forward (src/prefetch/keep_params.h). If the guess is
// wrong, the params are simply freed later: by the unit's own backward, or at the end of
// backward, or by its next forward. Peak memory is unchanged: the backward would gather the same
// unit at that point.
void ShardedUnit::post_forward() {
  // The root's backward starts right after its forward: unless told otherwise, keep its params
  // (saves one all-gather of the root per step). A recomputation inside backward (activation
  // checkpointing) keeps them too: its backward follows at once. The rule is
  // prefetch::keeps_params_after_forward, which the offload plan applies too.
  RootState& rs = root_state();
  const bool in_backward = rs.in_backward;
  const bool grad = c10::GradMode::is_enabled();
  if (!in_backward && rs.step_trains) forward_had_grad_ = grad;
  // Inside a Join every gather is agreed, so none is kept (a unit's next use gathers it again).
  if (rs.joined || !prefetch::keeps_params_after_forward(forward_end(rs.order.ran_last(index_), grad, in_backward))) {
    // Note [Resharding to a group]: only when a backward will gather again (not inside a Join).
    if (!rs.joined && grad && !in_backward) {
      reshard_to_group();
    } else {
      reshard();
    }
  }
  state_ = in_backward ? TrainingState::kPreBackward : TrainingState::kIdle;
  // Buffers changed by a training forward are synchronised at the end of backward, once the
  // graph that saved them is done (or by the next forward, if no backward comes).
  if (is_root() && !in_backward) {
    auto module = module_.lock();
    if (module && module->is_training()) rs.buffers_dirty = true;
  }
  if (Tracer* t = tracer())
    t->span("fsdp::forward", "compute", forward_begin_, std::chrono::steady_clock::now(), name());
}

void ShardedUnit::pre_backward() {
  RootState& rs = root_state();
  if (!rs.callback_queued) {
    rs.callback_queued = true;
    rs.in_backward = true;
    ShardedUnit* root = root_;
    torch::autograd::Engine::get_default_engine().queue_callback([root] { root->finalize_backward(); });
  }
  if (state_ != TrainingState::kPreBackward) backward_begin_ = std::chrono::steady_clock::now();
  join_round();
  unshard();
  if (!rs.joined) {
    RootUnits units(rs);
    prefetch::before_backward(rs.order, index_, explicit_targets(backward_prefetch_), prefetch_limits(), units);
  }
  wait_for_unshard();
  for (auto& fp : flat_params_) fp->grads().prepare();
  note_memory();
  state_ = TrainingState::kPreBackward;
}

void ShardedUnit::on_grad_ready(size_t i, size_t k) {
  if (!flat_params_[i]->grads().prepared()) {
    // No pre-backward ran: the gradient came through a forward fsdp never saw, and it would be lost.
    auto module = module_.lock();
    throw UsageError("fsdp: a gradient reached sharded module '" + name() + "' (" +
                     (module ? module->name() : std::string("?")) +
                     ") through a forward that did not run through fsdp::call, so it would never be reduced; run "
                     "the module as fsdp::call(module, args...) (a block inside a torch::nn::Sequential, ModuleList "
                     "or AnyModule: wrap it with fsdp::Sharded, docs/WRAPPING.md)");
  }
  flat_params_[i]->grads().landed(k);
  if (++grads_landed_[i] == flat_params_[i]->entries().size()) post_backward(i);
}

void ShardedUnit::post_backward(size_t i) {
  if (post_backward_done_[i]) return;
  post_backward_done_[i] = true;
  FlatParam& flat = *flat_params_[i];
  if (requires_gradient_sync_ && !flat.grads().requires_all_reduce() && flat.replicate_group().size() > 1 &&
      steps_in_backward()) {
    throw UsageError(
        "fsdp: " + name() + " reduces its gradients with set_requires_all_reduce(false) while the " +
        "optimizer steps in backward, which would apply a gradient not yet all-reduced across the " +
        "replicas; accumulate with set_requires_gradient_sync(false) instead, or turn off step_in_backward");
  }
  if (requires_gradient_sync_ && !root_state().joined) {  // inside a Join: at the end of backward
    // Reductions issued by earlier units have had this unit's backward to finish: collect them now,
    // which frees their gradient buffers, so at most one unit's gradients wait on the wire besides
    // this unit's own. This unit's other flat params' reductions were issued a moment ago (a unit's
    // flat params finish backward together): waiting for those would serialise every reduction
    // with the backward, so they stay pending until the next unit's.
    RootState& rs = root_state();
    std::vector<FlatParam*> own;
    for (FlatParam* fp : rs.pending_reduces) {
      const bool mine = std::any_of(flat_params_.begin(), flat_params_.end(),
                                    [fp](const std::unique_ptr<FlatParam>& f) { return f.get() == fp; });
      if (mine) {
        own.push_back(fp);
        continue;
      }
      fp->grads().finalize();
      // Note [The step in backward]; sums still waiting for the replicas' all-reduce are no gradient yet.
      if (rs.post_reduce_hook != nullptr && !fp->grads().holds_partial()) {
        GradShard shard(fp);
        rs.post_reduce_hook->gradient_reduced(shard);
      }
    }
    rs.pending_reduces = std::move(own);
    flat_params_[i]->grads().reduce_scatter();
    rs.pending_reduces.push_back(flat_params_[i].get());
  }
  maybe_end_backward();
}

// Note [When a unit's backward ends]
// A unit's params are freed once its backward is over. With trainable params only, that is when
// every gradient has landed. Frozen params (a LoRA base) are read by backward nodes that produce
// no parameter gradient, e.g. the input gradient of a frozen Linear, which may run after the
// last trainable gradient landed: the unit also waits for the gradients of its forward's inputs
// (a hook on each input that requires grad, counted in inputs_pending_), which autograd computes
// only after every node of the unit that leads to them. A node that leads to neither never runs.
// A unit with nothing of this to wait for (no trainable params, no input that requires grad) is
// freed by finalize_backward, as before.
void ShardedUnit::maybe_end_backward() {
  if (state_ == TrainingState::kPostBackward) return;
  bool trainable = false, all_done = !has_frozen_ || inputs_pending_ == 0;
  for (size_t k = 0; k < flat_params_.size() && all_done; ++k) {
    trainable = trainable || flat_params_[k]->config().requires_grad;
    all_done = post_backward_done_[k] || !flat_params_[k]->config().requires_grad;
  }
  if (!all_done || (!trainable && inputs_seen_ == 0)) return;
  if (reshard_after_backward_ || root_state().joined) reshard();  // Note [Kept gathers]; a Join keeps none
  state_ = TrainingState::kPostBackward;
  if (Tracer* t = tracer())
    t->span("fsdp::backward", "compute", backward_begin_, std::chrono::steady_clock::now(), name());
}

at::Tensor ShardedUnit::track_input(const at::Tensor& t) {
  if (!has_frozen_ || !t.defined() || !t.requires_grad() || !c10::GradMode::is_enabled()) return t;
  ++inputs_pending_;
  ++inputs_seen_;
  std::weak_ptr<ShardedUnit> weak = weak_from_this();
  at::Tensor tracked = t;
  tracked.register_hook([weak](const at::Tensor&) {
    auto unit = weak.lock();
    if (!unit || unit->inputs_pending_ == 0) return;
    --unit->inputs_pending_;
    if (unit->state_ == TrainingState::kPreBackward) unit->maybe_end_backward();
  });
  return tracked;
}

// Note [Lazy gradient collection]
// The end of backward issues the reductions that did not start yet but waits for none: the
// optimizer collects each flat param's gradient just before stepping it (collect_gradients for
// everything at once, e.g. for clipping), so its step overlaps the last reduce-scatters. A
// reduction nobody collected is collected before its buffer is reused in the next backward.
void ShardedUnit::finalize_backward() {
  RootState& rs = root_state();
  // Inside a Join every unit's reduction starts here, together (Note [Join rounds]).
  if (rs.joined) join_reduce_round();
  // Units whose gradients did not all land (unused params, a skipped unit) are reduced now; the
  // order is the same on every rank because the unit list is. Inside a Join, a unit this rank's
  // forward skipped reduces zeros.
  for (ShardedUnit* unit : rs.units) {
    if (!unit->requires_gradient_sync_) continue;
    for (auto& fp : unit->flat_params_) {
      if (rs.joined && fp->config().requires_grad && !fp->grads().prepared()) fp->grads().prepare();
      if (fp->grads().prepared()) {
        fp->grads().reduce_scatter();
      } else if (fp->grads().requires_all_reduce()) {
        fp->grads().flush_partial();  // Note [Accumulation without the all-reduce]: no gradient this time
      }
    }
  }
  rs.pending_reduces.clear();
  verify_collectives(rs);
  Tracer* t = tracer();
  for (ShardedUnit* unit : rs.units) {
    if (t != nullptr && unit->state_ == TrainingState::kPreBackward) {
      t->span("fsdp::backward", "compute", unit->backward_begin_, std::chrono::steady_clock::now(), unit->name());
    }
    if (unit->reshard_after_backward_ || rs.joined) unit->reshard();  // Note [Kept gathers]; a Join keeps none
    for (auto& fp : unit->flat_params_) fp->grads().guard();          // Note [Guarded gradients] in param_data.h
    unit->reset_after_backward();
  }
  rs.callback_queued = false;
  rs.in_backward = false;
  // The forward (and any recomputation in this backward) updated the buffers, each rank its way.
  if (rs.buffers_dirty || rs.recomputed) sync_buffers();
  rs.recomputed = false;
}

// Note [Identity check in the queue] (src/comm/id_check.cpp): on a transport whose messages cannot
// carry a collective's identity, the ranks compare what they ran before any optimizer step; on
// the CPU transports each collective was checked as it ran and this returns at once.
void ShardedUnit::verify_collectives(RootState& rs) {
  if (!rs.queue_checked_groups) {
    // The units and their groups are fixed at lazy init: found once, in the same order on every rank.
    std::vector<Communicator*> groups;
    for (ShardedUnit* unit : rs.units) {
      for (auto& fp : unit->flat_params_) {
        for (Communicator* g : {&fp->shard_group(), &fp->replicate_group(), unit->post_forward_group_}) {
          if (g != nullptr && g->checks_ids_in_queue() && std::find(groups.begin(), groups.end(), g) == groups.end()) {
            groups.push_back(g);
          }
        }
      }
    }
    rs.queue_checked_groups = std::move(groups);
  }
  for (Communicator* g : *rs.queue_checked_groups) g->verify_collectives("end of backward");
}

void ShardedUnit::collect_gradients() {
  for (auto& fp : flat_params_) fp->grads().finalize();
}

void ShardedUnit::reset_after_backward() {
  std::fill(grads_landed_.begin(), grads_landed_.end(), 0);
  std::fill(post_backward_done_.begin(), post_backward_done_.end(), false);
  inputs_pending_ = inputs_seen_ = 0;
  awaits_backward_ = false;
  state_ = TrainingState::kIdle;
}

void ShardedUnit::note_memory() {
  if (root_ == nullptr) return;
  RootState& rs = root_state();
  int64_t alive = 0;
  int gathered = 0;
  for (ShardedUnit* unit : rs.units) {
    for (auto& fp : unit->flat_params_) alive += fp->unsharded_bytes() + fp->unsharded_grad_bytes();
    gathered += unit->is_gathered_or_gathering() ? 1 : 0;
  }
  rs.peak_unsharded_bytes = std::max(rs.peak_unsharded_bytes, alive);
  rs.peak_gathered_units = std::max(rs.peak_gathered_units, gathered);
}

}  // namespace fsdp
