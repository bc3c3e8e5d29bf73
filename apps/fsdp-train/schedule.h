// fsdp-train's learning-rate schedule: optim.{schedule, lr, warmup_steps, min_lr} and train.steps,
// as one value that a checkpoint saves (TrainState.extra.lr_schedule) and a resume compares.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "config.h"
#include "fsdp/optim.h"

namespace train {

struct ScheduleSpec {
  Schedule schedule = Schedule::kCosine;  // cosine (to min_lr at total_steps) or constant
  double lr = 0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // train.steps
  double min_lr = 0;

  static ScheduleSpec of(const TrainConfig& config);
  // {"schedule", "lr", "warmup_steps", "total_steps", "min_lr", "next_lr"}: next_lr is the lr of the
  // step after `step` steps (what a resume there would use).
  nlohmann::json to_json(int64_t step) const;
  // The saved form back; nullopt when a key is missing or of the wrong type (an older checkpoint).
  static std::optional<ScheduleSpec> from_json(const nlohmann::json& j);
};

// Linear warmup to lr over warmup_steps, then cosine decay to min_lr at total_steps
// (fsdp::WarmupCosine) or constant.
std::unique_ptr<fsdp::LRScheduler> make_schedule(const ScheduleSpec& spec);

}  // namespace train
