// ExecutionOrder: the order in which units ran forward, recorded every step, and the prefetch
// targets derived from it. A step prefetches by the order the previous step recorded (forward)
// or this step's (backward); if a step runs in another order, the wrong guesses only cost an
// early gather (each target is still gathered through the same idempotent unshard, and resharded
// at the end of backward at the latest), and the next step uses the new order.
//
// Units are named by their index in the root's unit list (UnitIndex); the prefetch layer knows
// nothing else about them.
#pragma once

#include <cstddef>
#include <unordered_map>
#include <vector>

namespace fsdp::prefetch {

using UnitIndex = size_t;

class ExecutionOrder {
 public:
  // Starts a step: the order recorded in the last one becomes the forward prediction.
  void begin_step();
  // A unit's forward began (first time this step counts).
  void record(UnitIndex unit);
  // Up to `depth` units expected to run forward after `unit`.
  std::vector<UnitIndex> next_in_forward(UnitIndex unit, int depth) const;
  // Up to `depth` units whose backward follows `unit`'s (this step's forward order, reversed).
  std::vector<UnitIndex> next_in_backward(UnitIndex unit, int depth) const;
  // Whether `unit` ran forward last in the previous step and as many units ran before it in this
  // step as then: the order looks the same (Note [The last unit keeps its params]).
  bool ran_last(UnitIndex unit) const;
  const std::vector<UnitIndex>& recorded() const { return recording_; }
  const std::vector<UnitIndex>& predicted() const { return predicted_; }
  // The latest complete forward order seen: this step's between steps, else the previous one's.
  const std::vector<UnitIndex>& latest() const { return recording_.empty() ? predicted_ : recording_; }

 private:
  std::vector<UnitIndex> predicted_;  // last step's forward order
  std::unordered_map<UnitIndex, size_t> predicted_index_;
  std::vector<UnitIndex> recording_;  // this step's, so far
  std::unordered_map<UnitIndex, size_t> recording_index_;
};

}  // namespace fsdp::prefetch
