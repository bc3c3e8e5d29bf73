// Uneven inputs: ranks that run different numbers of forwards, or forwards that reach different
// units, under one sharded root.
//
// Every gather and every gradient reduction of a sharded unit is a collective: all ranks of its
// group must run it, in the same order. Without a Join, a rank that runs one forward fewer, or
// whose batch skips a unit (an expert no token was routed to), makes the ranks' collectives
// differ, and fsdp fails every rank at once naming both (the desync check). Inside a Join the
// ranks agree before each gather which one runs next, and a rank that has nothing to gather (it
// finished its loop, or skipped that unit) takes part in it with its shard; the others' results
// are exactly those of the unsharded model:
//
//   fsdp::Join join(*root);                          // every rank, before its loop
//   for (auto& batch : my_batches) {                 // any number per rank
//     auto logits = fsdp::call(model, batch);        // generation, eval, or a training step
//     ...
//   }
//   join.finish();                                   // takes part in the others' gathers until
//                                                    // every rank has finished
//
// What it covers:
//  - generation of different lengths and eval sets that do not divide evenly: forwards without
//    gradients, any number per rank;
//  - a unit that one rank's forward skips, in eval or in training: its gathers are shared as
//    above, and its gradient is reduced on every rank (zero where the unit did not run), so the
//    step equals the unsharded model's on the whole batch;
//  - ordinary steps after finish(), whatever each rank ran inside: the Join's forwards are left
//    out of the execution order each rank predicts its gathers by (Note [Join rounds]).
// What it refuses: a training step (a backward) while some rank has finished: that rank's shard
// would miss the optimizer step. Every rank then throws fsdp::UsageError; give every rank the same
// number of training steps (drop or pad the remainder) and use the Join for what is uneven
// within them.
//
// The cost, only inside a Join: one small all-reduce before each gather (the agreement), no
// prefetch, every unit freed after its forward, and the gradient reductions issued at the end of
// backward in unit order instead of overlapping it (the unsharded gradients of every unit are
// held until then).
#pragma once

#include <memory>

namespace fsdp {

class FSDPModule;
class ShardedUnit;

class Join {
 public:
  // Collective: every rank of the root's mesh constructs it, with the same root. Initialises the
  // root if no forward has yet (a rank with no input at all joins at once).
  explicit Join(FSDPModule& root);
  // Leaves the Join on this rank without waiting (an exception on the way out); call finish()
  // on every rank that completed its loop.
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // This rank is done: it takes part in the other ranks' gathers until every rank has called
  // finish(). Throws UsageError (on every rank) when another rank starts a backward meanwhile.
  void finish();

 private:
  std::shared_ptr<ShardedUnit> root_;
  bool finished_ = false;
};

}  // namespace fsdp
