// fsdp::Join (fsdp/join.h): the rounds in which the ranks agree which gather runs next.
#include "fsdp/join.h"

#include <ATen/ATen.h>

#include "fsdp/errors.h"
#include "shard/sharded_unit.h"

namespace fsdp {

// Note [Join rounds]
// Inside a Join, before a unit gathers its params (its forward, its backward, a recomputation),
// the ranks of the world run a round: one all-reduce of a count per key, each rank adding one at
// the key it proposes: the unit it is about to gather (its index in the root's unit list), kReduce
// at the end of a backward, kDone once it has finished its loop. The lowest key proposed wins:
// the ranks that proposed it go on (a gather, or the end of backward's reductions); every other
// rank takes part in that gather with its shard (FlatParam::shadow_gather) and proposes again. So
// every rank runs the same rounds and the same collectives, whatever each one's forwards were,
// and a rank's own gathers are its own units' full params: its results are the unsharded model's.
// Every round moves some rank on, so the rounds end when every rank proposes kDone. kReduce
// wins only when no rank still wants a gather, so the reductions of a backward start together
// on every rank, each unit's in unit order (a unit a rank skipped reduces zeros). kReduce beside
// kDone means a rank has finished while others train: every rank throws (the finished rank's
// shard would miss the step).
// A Join's forwards differ by rank, so the execution order (keep-for-backward, prefetch) leaves
// them out: the step after the Join predicts by the last before it, alike on every rank.
namespace {

struct RoundResult {
  size_t winner = 0;
  bool someone_done = false;
};

RoundResult run_round(RootState& rs, Communicator& world, size_t key) {
  const size_t done = rs.units.size() + 1;
  at::Tensor counts = at::zeros({static_cast<int64_t>(done + 1)}, at::kFloat);
  counts[static_cast<int64_t>(key)] = 1.0f;
  world.all_reduce(counts, ReduceOp::kSum, "join round").wait();
  RoundResult r;
  const float* c = counts.data_ptr<float>();
  while (r.winner < done && !(c[r.winner] > 0.5f)) ++r.winner;  // the lowest key proposed (done if none below)
  r.someone_done = c[done] > 0.5f;
  return r;
}

void shadow(RootState& rs, size_t unit) {
  for (auto& fp : rs.units[unit]->flat_params()) fp->gathered().shadow_gather();
}

UsageError finished_while_training() {
  return UsageError(
      "fsdp::Join: a rank finished (Join::finish) while another ran a backward: the finished rank's shard would "
      "miss that optimizer step. Give every rank the same number of training steps (drop or pad the remainder "
      "of its data); inside them, forwards that reach different units are fine");
}

}  // namespace

void ShardedUnit::join_round() {
  RootState& rs = root_state();
  if (!rs.joined || is_gathered_or_gathering()) return;
  Communicator& world = mesh_.dist().world();
  for (;;) {
    const RoundResult r = run_round(rs, world, index_);
    if (r.winner == index_) return;
    shadow(rs, r.winner);
  }
}

void ShardedUnit::join_reduce_round() {
  RootState& rs = root_state();
  const size_t reduce = rs.units.size();
  Communicator& world = mesh_.dist().world();
  for (;;) {
    const RoundResult r = run_round(rs, world, reduce);
    if (r.winner == reduce) {
      if (r.someone_done) throw finished_while_training();
      return;
    }
    shadow(rs, r.winner);
  }
}

void ShardedUnit::join_finish() {
  RootState& rs = root_state();
  const size_t reduce = rs.units.size(), done = reduce + 1;
  Communicator& world = mesh_.dist().world();
  for (;;) {
    const RoundResult r = run_round(rs, world, done);
    if (r.winner == done) break;
    if (r.winner == reduce) throw finished_while_training();
    shadow(rs, r.winner);
  }
  // A training-mode forward without a backward changed buffers, on some ranks: every rank is here.
  at::Tensor dirty = at::full({1}, rs.buffers_dirty ? 1.0f : 0.0f);
  world.all_reduce(dirty, ReduceOp::kSum, "join buffers").wait();
  if (dirty.item<float>() > 0) sync_buffers();
}

void ShardedUnit::set_joined(bool joined) {
  RootState& rs = root_state();
  if (joined) {
    // Every unit starts the Join sharded (a unit kept gathered by the last forward), so a gather
    // is needed, and proposed, at the same points on every rank.
    for (ShardedUnit* unit : rs.units) unit->reshard();
  }
  rs.joined = joined;
}

Join::Join(FSDPModule& root) : root_(unit_of(root).shared_from_this()) {
  if (root_->root() == nullptr) {
    if (root_->nested()) {
      throw UsageError("fsdp::Join: module '" + root_->path_before_root() +
                       "' is not a root: a larger module was sharded over it. Give the Join the handle fully_shard "
                       "returned for the whole model");
    }
    root_->lazy_init();
  }
  if (!root_->is_root()) {
    throw UsageError("fsdp::Join: module '" + root_->name() +
                     "' is not a root. Give the Join the handle fully_shard returned for the whole model");
  }
  if (root_->root_state().joined) throw UsageError("fsdp::Join: this root is already inside a Join");
  root_->set_joined(true);
}

Join::~Join() {
  if (root_) root_->root_state().joined = false;
}

void Join::finish() {
  if (finished_) throw UsageError("fsdp::Join::finish: called twice");
  finished_ = true;
  root_->join_finish();
  root_->set_joined(false);
}

}  // namespace fsdp
