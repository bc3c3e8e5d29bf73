// See policy.h.
#include "prefetch/policy.h"

namespace fsdp::prefetch {
namespace {

// Issues the all-gathers of `targets` that are not gathered yet, within the cap on units gathered
// at once. Never waits: the target's own pre_forward / pre_backward waits.
void gather(const std::vector<UnitIndex>& targets, UnitIndex self, int max_unsharded_units, Units& units) {
  for (UnitIndex target : targets) {
    if (target == self || units.gathered_or_gathering(target)) continue;
    if (max_unsharded_units > 0) {
      int alive = 0;
      for (UnitIndex u = 0; u < units.count(); ++u) alive += units.gathered_or_gathering(u) ? 1 : 0;
      if (alive >= max_unsharded_units) return;
    }
    units.gather(target);
  }
}

// Starts the disk reads of the master shards `targets` will gather (one unit beyond the
// prefetched ones, so that each all-gather finds its input read): Note [Disk tier I/O threads].
void read_ahead(const std::vector<UnitIndex>& targets, UnitIndex self, Units& units) {
  for (UnitIndex target : targets) {
    if (target == self || units.gathered_or_gathering(target)) continue;
    units.read_ahead(target);
  }
}

}  // namespace

namespace {

// The units after `self` in one direction, within `depth`.
std::vector<UnitIndex> next(const ExecutionOrder& order, UnitIndex self, int depth, bool forward) {
  return forward ? order.next_in_forward(self, depth) : order.next_in_backward(self, depth);
}

// In backward, the units whose backward is over are no targets (Units::backward_done).
std::vector<UnitIndex> wanted(std::vector<UnitIndex> targets, bool forward, const Units& units) {
  if (forward) return targets;
  std::vector<UnitIndex> out;
  for (UnitIndex t : targets) {
    if (!units.backward_done(t)) out.push_back(t);
  }
  return out;
}

void before(const ExecutionOrder& order, UnitIndex self, const ExplicitTargets& explicit_targets, const Limits& limits,
            Units& units, bool forward) {
  if (limits.prefetch_depth > 0) {
    gather(wanted(explicit_targets ? *explicit_targets : next(order, self, limits.prefetch_depth, forward), forward,
                  units),
           self, limits.max_unsharded_units, units);
  }
  if (limits.read_ahead) {
    read_ahead(wanted(next(order, self, limits.prefetch_depth + 1, forward), forward, units), self, units);
  }
}

}  // namespace

void before_forward(const ExecutionOrder& order, UnitIndex self, const ExplicitTargets& explicit_targets,
                    const Limits& limits, Units& units) {
  before(order, self, explicit_targets, limits, units, /*forward=*/true);
}

void before_backward(const ExecutionOrder& order, UnitIndex self, const ExplicitTargets& explicit_targets,
                     const Limits& limits, Units& units) {
  before(order, self, explicit_targets, limits, units, /*forward=*/false);
}

}  // namespace fsdp::prefetch
