// See schedule.h.
#include "schedule.h"

namespace train {

ScheduleSpec ScheduleSpec::of(const TrainConfig& config) {
  ScheduleSpec s;
  s.schedule = config.optim.schedule;
  s.lr = config.optim.lr;
  s.warmup_steps = config.optim.warmup_steps;
  s.total_steps = config.train.steps;
  s.min_lr = config.optim.min_lr;
  return s;
}

nlohmann::json ScheduleSpec::to_json(int64_t step) const {
  return {{"schedule", name_of(kSchedules, schedule)},
          {"lr", lr},
          {"warmup_steps", warmup_steps},
          {"total_steps", total_steps},
          {"min_lr", min_lr},
          {"next_lr", make_schedule(*this)->lr_at(step)}};
}

std::optional<ScheduleSpec> ScheduleSpec::from_json(const nlohmann::json& j) {
  if (!j.is_object()) return std::nullopt;
  const auto number = [&](const char* k) { return j.contains(k) && j[k].is_number(); };
  const auto integer = [&](const char* k) { return j.contains(k) && j[k].is_number_integer(); };
  if (!j.contains("schedule") || !j["schedule"].is_string() || !number("lr") || !integer("warmup_steps") ||
      !integer("total_steps") || !number("min_lr")) {
    return std::nullopt;
  }
  ScheduleSpec s;
  const auto name = j["schedule"].get<std::string>();
  const std::optional<Schedule> known = value_of(kSchedules, name);
  if (!known) return std::nullopt;
  s.schedule = *known;
  s.lr = j["lr"].get<double>();
  s.warmup_steps = j["warmup_steps"].get<int64_t>();
  s.total_steps = j["total_steps"].get<int64_t>();
  s.min_lr = j["min_lr"].get<double>();
  return s;
}

// Constant: the cosine's warmup, then a decay to lr itself, which is lr exactly.
std::unique_ptr<fsdp::LRScheduler> make_schedule(const ScheduleSpec& spec) {
  const double floor = spec.schedule == Schedule::kConstant ? spec.lr : spec.min_lr;
  return std::make_unique<fsdp::WarmupCosine>(spec.lr, spec.warmup_steps, spec.total_steps, floor);
}

}  // namespace train
