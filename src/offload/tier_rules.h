// The disk tier's two sizes, each one rule that the runtime applies and the planner costs by, so a
// plan's window and chunks are the run's (tests/threads/tier_rules_test.cpp holds them equal):
// the elements of a chunk the tier streams through host memory (FileTier::chunk_elements; the
// planner's reads of a save, plan_cost.cpp), and the window of budgeted buffers the streamed
// optimizer step holds (streamed_step.cpp; the planner's "disk tier's mapped window").
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp::offload {

// Elements per tensor per chunk without a memory budget: 4 MiB of fp32.
constexpr int64_t kDefaultChunkElements = int64_t{1} << 20;

// Elements per chunk when `tensors` fp32 tensors stream together under `budget_bytes`
// (OffloadPolicy::memory_budget_bytes, 0: none): a third of the budget (read-ahead, current,
// write-behind) split over the tensors, in whole 4 KiB pages of 1024 elements; 0 when the budget
// holds less than a page of each of them three times.
inline int64_t chunk_elements(int64_t budget_bytes, int tensors) {
  if (budget_bytes <= 0) return kDefaultChunkElements;
  return budget_bytes / (3 * std::max(tensors, 1) * int64_t{4}) / 1024 * 1024;
}

// The bytes of budgeted buffers the streamed step holds at most, its chunks taking `chunk_bytes`
// of reads each: the budget, or without one three chunks (read-ahead, current, write-behind).
// Unbounded, the write-behind grew whenever the step outran the disk (a first step, whose reads of
// new zero states are quick: 0.6 GiB above the plan at 0.5B), and every job's prefetched first
// chunk was held through the backward.
inline int64_t step_window(int64_t budget_bytes, int64_t chunk_bytes) {
  return budget_bytes > 0 ? budget_bytes : 3 * chunk_bytes;
}

}  // namespace fsdp::offload
