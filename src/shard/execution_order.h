// ExecutionOrder: the order in which units ran forward, recorded every step, and the prefetch
// targets derived from it. A step prefetches by the order the previous step recorded (forward)
// or this step's (backward); if a step runs in another order, the wrong guesses only cost an
// early gather (each target is still gathered through the same idempotent unshard, and resharded
// at the end of backward at the latest), and the next step uses the new order.
#pragma once

#include <cstddef>
#include <unordered_map>
#include <vector>

namespace fsdp {

class ShardedUnit;

class ExecutionOrder {
 public:
  // Starts a step: the order recorded in the last one becomes the forward prediction.
  void begin_step();
  // A unit's forward began (first time this step counts).
  void record(ShardedUnit* unit);
  // Up to `depth` units expected to run forward after `unit`.
  std::vector<ShardedUnit*> next_in_forward(ShardedUnit* unit, int depth) const;
  // Up to `depth` units whose backward follows `unit`'s (this step's forward order, reversed).
  std::vector<ShardedUnit*> next_in_backward(ShardedUnit* unit, int depth) const;
  const std::vector<ShardedUnit*>& recorded() const { return recording_; }
  const std::vector<ShardedUnit*>& predicted() const { return predicted_; }

 private:
  std::vector<ShardedUnit*> predicted_;  // last step's forward order
  std::unordered_map<ShardedUnit*, size_t> predicted_index_;
  std::vector<ShardedUnit*> recording_;  // this step's, so far
  std::unordered_map<ShardedUnit*, size_t> recording_index_;
};

}  // namespace fsdp
