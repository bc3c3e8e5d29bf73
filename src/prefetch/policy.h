// The prefetch policy: which units to gather next, before a unit's forward and before its
// backward, within prefetch_depth and max_unsharded_units. The shard layer asks it through
// `Units` (unit indices in the root's unit list), so this layer needs none of shard's types.
#pragma once

#include <optional>
#include <vector>

#include "prefetch/execution_order.h"

namespace fsdp::prefetch {

// What the policy asks of the units it plans for (the shard layer implements it over its units).
class Units {
 public:
  virtual ~Units() = default;
  virtual size_t count() const = 0;
  // Params gathered, or their all-gather issued.
  virtual bool gathered_or_gathering(UnitIndex unit) const = 0;
  // Issues the unit's all-gather (never waits).
  virtual void gather(UnitIndex unit) = 0;
  // Starts the disk reads of the master shards the unit's all-gather will need.
  virtual void read_ahead(UnitIndex unit) = 0;
  // Its backward is over in the backward running now: nothing reads its params again this step, so
  // the backward's prefetch passes it by (a root whose own backward ran first, e.g. a head alone),
  // or it will not run one (no output of its forward required grad: a frozen embedding).
  virtual bool backward_done(UnitIndex unit) const { return false; }
};

// A unit's explicit prefetch list (FSDPModule::set_modules_to_forward_prefetch and the backward
// one), when it has one: it replaces the recorded order's guess.
using ExplicitTargets = std::optional<std::vector<UnitIndex>>;

// The asking unit's limits (its resolved options).
struct Limits {
  int prefetch_depth = 1;       // units gathered ahead; 0: none
  int max_unsharded_units = 0;  // units gathered at once, at most; 0: no cap
  bool read_ahead = false;      // a disk tier: start the reads one unit beyond the prefetched ones
};

// Before `self`'s forward, after its own gather was issued: gathers the units expected to run
// forward next (`explicit_targets` when given, else the previous step's order) and starts
// the reads beyond them.
void before_forward(const ExecutionOrder& order, UnitIndex self, const ExplicitTargets& explicit_targets,
                    const Limits& limits, Units& units);
// The same before `self`'s backward, by this step's forward order reversed.
void before_backward(const ExecutionOrder& order, UnitIndex self, const ExplicitTargets& explicit_targets,
                     const Limits& limits, Units& units);

}  // namespace fsdp::prefetch
