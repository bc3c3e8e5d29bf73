// See execution_order.h.
#include "shard/execution_order.h"

namespace fsdp {

void ExecutionOrder::begin_step() {
  if (!recording_.empty()) {
    predicted_ = recording_;
    predicted_index_ = recording_index_;
  }
  recording_.clear();
  recording_index_.clear();
}

void ExecutionOrder::record(ShardedUnit* unit) {
  if (recording_index_.emplace(unit, recording_.size()).second) recording_.push_back(unit);
}

std::vector<ShardedUnit*> ExecutionOrder::next_in_forward(ShardedUnit* unit, int depth) const {
  std::vector<ShardedUnit*> out;
  auto it = predicted_index_.find(unit);
  if (it == predicted_index_.end()) return out;
  for (size_t i = it->second + 1; i < predicted_.size() && static_cast<int>(out.size()) < depth; ++i) {
    out.push_back(predicted_[i]);
  }
  return out;
}

std::vector<ShardedUnit*> ExecutionOrder::next_in_backward(ShardedUnit* unit, int depth) const {
  std::vector<ShardedUnit*> out;
  auto it = recording_index_.find(unit);
  if (it == recording_index_.end()) return out;
  for (size_t i = it->second; i-- > 0 && static_cast<int>(out.size()) < depth;) out.push_back(recording_[i]);
  return out;
}

}  // namespace fsdp
