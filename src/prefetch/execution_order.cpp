// See execution_order.h.
#include "prefetch/execution_order.h"

namespace fsdp::prefetch {

void ExecutionOrder::begin_step() {
  if (!recording_.empty()) {
    predicted_ = recording_;
    predicted_index_ = recording_index_;
  }
  recording_.clear();
  recording_index_.clear();
}

void ExecutionOrder::record(UnitIndex unit) {
  if (recording_index_.emplace(unit, recording_.size()).second) recording_.push_back(unit);
}

std::vector<UnitIndex> ExecutionOrder::next_in_forward(UnitIndex unit, int depth) const {
  std::vector<UnitIndex> out;
  auto it = predicted_index_.find(unit);
  if (it == predicted_index_.end()) return out;
  for (size_t i = it->second + 1; i < predicted_.size() && static_cast<int>(out.size()) < depth; ++i) {
    out.push_back(predicted_[i]);
  }
  return out;
}

std::vector<UnitIndex> ExecutionOrder::next_in_backward(UnitIndex unit, int depth) const {
  std::vector<UnitIndex> out;
  auto it = recording_index_.find(unit);
  if (it == recording_index_.end()) return out;
  for (size_t i = it->second; i-- > 0 && static_cast<int>(out.size()) < depth;) out.push_back(recording_[i]);
  return out;
}

bool ExecutionOrder::ran_last(UnitIndex unit) const {
  return !predicted_.empty() && predicted_.back() == unit && recording_.size() == predicted_.size();
}

}  // namespace fsdp::prefetch
