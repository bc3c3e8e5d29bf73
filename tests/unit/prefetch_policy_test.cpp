// The prefetch layer alone (src/prefetch): the execution order's predictions, the policy's cap on
// gathered units and its explicit lists, and the keep-params rule's cases, over plain indices.
#include <gtest/gtest.h>

#include <set>

#include "prefetch/execution_order.h"
#include "prefetch/keep_params.h"
#include "prefetch/policy.h"

namespace fsdp::prefetch {
namespace {

// Units that only count: a set of gathered ones, and what was asked of them.
struct FakeUnits final : Units {
  size_t n = 0;
  std::set<UnitIndex> gathered, backward_over;
  std::vector<UnitIndex> gathers, reads;
  size_t count() const override { return n; }
  bool gathered_or_gathering(UnitIndex unit) const override { return gathered.count(unit) > 0; }
  void gather(UnitIndex unit) override {
    gathered.insert(unit);
    gathers.push_back(unit);
  }
  void read_ahead(UnitIndex unit) override { reads.push_back(unit); }
  bool backward_done(UnitIndex unit) const override { return backward_over.count(unit) > 0; }
};

ExecutionOrder order_of(const std::vector<UnitIndex>& units) {
  ExecutionOrder order;
  order.begin_step();
  for (UnitIndex u : units) order.record(u);
  order.begin_step();  // the recorded order becomes the prediction
  return order;
}

TEST(PrefetchPolicy, ForwardFollowsTheLastStepsOrderWithinDepth) {
  ExecutionOrder order = order_of({0, 3, 1, 2});
  FakeUnits units;
  units.n = 4;
  units.gathered = {3};  // issued already: not gathered twice
  Limits limits;
  limits.prefetch_depth = 2;
  limits.read_ahead = true;
  before_forward(order, 0, std::nullopt, limits, units);
  EXPECT_EQ(units.gathers, (std::vector<UnitIndex>{1}));
  EXPECT_EQ(units.reads, (std::vector<UnitIndex>{2}));  // depth + 1 ahead, not the gathered ones
}

TEST(PrefetchPolicy, BackwardFollowsThisStepsOrderReversed) {
  ExecutionOrder order;
  order.begin_step();
  for (UnitIndex u : {0, 1, 2, 3}) order.record(u);
  FakeUnits units;
  units.n = 4;
  Limits limits;
  limits.prefetch_depth = 2;
  before_backward(order, 3, std::nullopt, limits, units);
  EXPECT_EQ(units.gathers, (std::vector<UnitIndex>{2, 1}));
  EXPECT_TRUE(units.reads.empty());  // no disk tier
}

// A unit whose backward is over (a root holding only a head, whose backward runs first) is not
// gathered again by the units after it, in the recorded order or an explicit list, nor read ahead;
// a forward prefetch is unaffected.
TEST(PrefetchPolicy, BackwardPassesByUnitsWhoseBackwardIsOver) {
  ExecutionOrder order;
  order.begin_step();
  for (UnitIndex u : {0, 1, 2, 3}) order.record(u);
  FakeUnits units;
  units.n = 4;
  units.backward_over = {0};
  Limits limits;
  limits.prefetch_depth = 2;
  limits.read_ahead = true;
  before_backward(order, 1, std::nullopt, limits, units);
  EXPECT_TRUE(units.gathers.empty());
  EXPECT_TRUE(units.reads.empty());
  before_backward(order, 2, std::vector<UnitIndex>{0, 1}, limits, units);
  EXPECT_EQ(units.gathers, (std::vector<UnitIndex>{1}));
  FakeUnits fwd;
  fwd.n = 4;
  fwd.backward_over = {0, 1, 2, 3};
  before_forward(order_of({3, 0, 1, 2}), 3, std::nullopt, limits, fwd);
  EXPECT_EQ(fwd.gathers, (std::vector<UnitIndex>{0, 1}));
}

TEST(PrefetchPolicy, CapStopsGathering) {
  ExecutionOrder order = order_of({0, 1, 2, 3, 4});
  FakeUnits units;
  units.n = 5;
  units.gathered = {0};
  Limits limits;
  limits.prefetch_depth = 4;
  limits.max_unsharded_units = 3;
  before_forward(order, 0, std::nullopt, limits, units);
  EXPECT_EQ(units.gathers, (std::vector<UnitIndex>{1, 2}));
}

TEST(PrefetchPolicy, ExplicitListReplacesTheOrderEvenWhenEmpty) {
  ExecutionOrder order = order_of({0, 1, 2});
  FakeUnits units;
  units.n = 3;
  Limits limits;
  before_forward(order, 0, ExplicitTargets{{0, 2}}, limits, units);
  EXPECT_EQ(units.gathers, (std::vector<UnitIndex>{2}));  // itself left out
  FakeUnits none;
  none.n = 3;
  before_forward(order, 0, ExplicitTargets{std::vector<UnitIndex>{}}, limits, none);
  EXPECT_TRUE(none.gathers.empty());
  limits.prefetch_depth = 0;
  before_forward(order, 0, ExplicitTargets{{1}}, limits, none);
  EXPECT_TRUE(none.gathers.empty());  // depth 0: no prefetch at all
}

TEST(PrefetchPolicy, RanLastNeedsTheSameNumberOfUnitsBeforeIt) {
  ExecutionOrder order = order_of({0, 1, 2});
  order.record(0);
  order.record(2);
  EXPECT_FALSE(order.ran_last(2));  // a unit was skipped: the order does not look the same
  order = order_of({0, 1, 2});
  for (UnitIndex u : {0, 1, 2}) order.record(u);
  EXPECT_TRUE(order.ran_last(2));
  EXPECT_FALSE(order.ran_last(1));
}

TEST(PrefetchPolicy, KeepParamsRule) {
  ForwardEnd f;  // a block, default options, not last
  EXPECT_FALSE(keeps_params_after_forward(f));
  f.ran_last = true;
  EXPECT_TRUE(keeps_params_after_forward(f));
  f.backward_follows = false;  // e.g. activation checkpointing: no gradients in its forward
  EXPECT_FALSE(keeps_params_after_forward(f));
  f.recomputing = true;  // the recomputation in backward keeps them
  EXPECT_TRUE(keeps_params_after_forward(f));
  ForwardEnd root;
  root.is_root = true;
  root.backward_follows = false;
  EXPECT_TRUE(keeps_params_after_forward(root));
  root.option_explicit = true;  // reshard_after_forward(true) set by the user
  EXPECT_FALSE(keeps_params_after_forward(root));
  ForwardEnd no_reshard;
  no_reshard.reshard_after_forward = false;
  EXPECT_TRUE(keeps_params_after_forward(no_reshard));
}

}  // namespace
}  // namespace fsdp::prefetch
