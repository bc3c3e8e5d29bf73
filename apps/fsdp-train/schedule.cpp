// See schedule.h.
#include "schedule.h"

namespace train {
namespace {

// Linear warmup to base_lr (as WarmupCosine's), then constant.
class WarmupConstant : public fsdp::LRScheduler {
 public:
  WarmupConstant(double base_lr, int64_t warmup_steps) : base_lr_(base_lr), warmup_steps_(warmup_steps) {}
  double lr_at(int64_t step) const override {
    if (step < warmup_steps_) return base_lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
    return base_lr_;
  }

 private:
  double base_lr_;
  int64_t warmup_steps_;
};

}  // namespace

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

std::unique_ptr<fsdp::LRScheduler> make_schedule(const ScheduleSpec& spec) {
  if (spec.schedule == Schedule::kConstant) return std::make_unique<WarmupConstant>(spec.lr, spec.warmup_steps);
  return std::make_unique<fsdp::WarmupCosine>(spec.lr, spec.warmup_steps, spec.total_steps, spec.min_lr);
}

}  // namespace train
