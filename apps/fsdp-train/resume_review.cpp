// See resume_review.h, Note [Resume changes].
#include "resume_review.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <cstdio>
#include <optional>
#include <stdexcept>

#include "metrics.h"
#include "schedule.h"

namespace train {
namespace {

using nlohmann::json;

std::string num(double x) { return format("%.4g", x); }

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}

bool differs(double a, double b) { return std::fabs(a - b) > 1e-12 + 1e-9 * std::max(std::fabs(a), std::fabs(b)); }

// The schedule keys that differ, as "key was -> now", and the flags that restore the saved ones.
struct ScheduleDiff {
  std::vector<std::string> changes, restore;
  bool only_steps() const { return changes.size() == 1 && changes[0].rfind("train.steps ", 0) == 0; }
};

ScheduleDiff schedule_diff(const ScheduleSpec& was, const ScheduleSpec& now) {
  ScheduleDiff d;
  const auto add = [&](const std::string& key, const std::string& a, const std::string& b, const std::string& flag) {
    d.changes.push_back(key + " " + a + " -> " + b);
    d.restore.push_back(flag);
  };
  const auto exact = [](double x) { return json(x).dump(); };  // round-trips the saved double
  if (was.total_steps != now.total_steps) {
    add("train.steps", std::to_string(was.total_steps), std::to_string(now.total_steps),
        "--steps " + std::to_string(was.total_steps));
  }
  if (was.schedule != now.schedule) {
    const std::string a = name_of(kSchedules, was.schedule), b = name_of(kSchedules, now.schedule);
    add("optim.schedule", a, b, "--set optim.schedule=" + a);
  }
  if (was.lr != now.lr) add("optim.lr", num(was.lr), num(now.lr), "--set optim.lr=" + exact(was.lr));
  if (was.warmup_steps != now.warmup_steps) {
    add("optim.warmup_steps", std::to_string(was.warmup_steps), std::to_string(now.warmup_steps),
        "--set optim.warmup_steps=" + std::to_string(was.warmup_steps));
  }
  if (was.min_lr != now.min_lr && (was.schedule == Schedule::kCosine || now.schedule == Schedule::kCosine)) {
    add("optim.min_lr", num(was.min_lr), num(now.min_lr), "--set optim.min_lr=" + exact(was.min_lr));
  }
  return d;
}

// The schedule's part of the review: a note when a key changed, and the error when the lr jumps.
void review_schedule(const ScheduleSpec& was, const ScheduleSpec& now, int64_t step, const std::string& checkpoint,
                     ResumeReview& out) {
  const ScheduleDiff d = schedule_diff(was, now);
  if (d.changes.empty()) return;
  std::string effect = "the schedule changes";
  if (d.only_steps()) {
    effect = now.schedule == Schedule::kCosine
                 ? "the cosine schedule is re-stretched to reach min_lr at step " + std::to_string(now.total_steps)
                 : "the constant schedule does not depend on it";
  }
  const std::string next = "step " + std::to_string(step + 1);
  if (step >= now.total_steps) {  // nothing left to train: no lr is used
    out.notes.push_back(join(d.changes, ", ") + ": " + effect);
    return;
  }
  const double a = make_schedule(was)->lr_at(step), b = make_schedule(now)->lr_at(step);
  if (differs(a, b)) {
    out.notes.push_back(join(d.changes, ", ") + ": " + effect + "; lr at " + next + " goes from " + num(a) + " to " +
                        num(b));
    out.lr_jump = "--resume " + checkpoint + " at step " + std::to_string(step) + ": the learning rate would jump at " +
                  next + " from " + num(a) + " (what the saved run's schedule gives there) to " + num(b) + ", since " +
                  join(d.changes, ", ") + " (" + effect + "). Resume with the saved run's settings (" +
                  join(d.restore, " ") + ") to continue its schedule, or pass --allow-schedule-change to accept it";
    return;
  }
  std::string later;
  const int64_t last = now.total_steps - 1;  // the last step this run trains, counted from 0
  const double la = make_schedule(was)->lr_at(last), lb = make_schedule(now)->lr_at(last);
  if (last > step && differs(la, lb)) {
    later = "; at step " + std::to_string(last + 1) + " it is " + num(lb) + " instead of " + num(la);
  }
  out.notes.push_back(join(d.changes, ", ") + ": " + effect + "; lr at " + next + " stays " + num(a) + later);
}

struct BatchShape {
  int64_t world = 0, per_rank = 0, accum = 0, global = 0;
};

// The integer at j[path[0]][path[1]]...; nullopt when any part is missing or of another type.
std::optional<int64_t> int_at(const json& j, std::initializer_list<const char*> path) {
  const json* at = &j;
  for (const char* key : path) {
    if (!at->is_object() || !at->contains(key)) return std::nullopt;
    at = &(*at)[key];
  }
  if (!at->is_number_integer()) return std::nullopt;
  return at->get<int64_t>();
}

std::optional<BatchShape> saved_batch(const fsdp::checkpoint::TrainState& state) {
  const auto per_rank = int_at(state.extra, {"config", "data", "batch_size_per_rank"});
  const auto accum = int_at(state.extra, {"config", "train", "grad_accum_steps"});
  const auto global = int_at(state.extra, {"global_batch"});
  if (!per_rank || !accum || !global) return std::nullopt;
  return BatchShape{state.world_size, *per_rank, *accum, *global};
}

// The global batch's part of the review: notes only.
void review_batch(const BatchShape& was, const BatchShape& now, int64_t samples_seen, ResumeReview& out) {
  std::vector<std::string> factors;
  if (was.world != now.world)
    factors.push_back("world size " + std::to_string(was.world) + " -> " + std::to_string(now.world));
  if (was.per_rank != now.per_rank) {
    factors.push_back("data.batch_size_per_rank " + std::to_string(was.per_rank) + " -> " +
                      std::to_string(now.per_rank));
  }
  if (was.accum != now.accum) {
    factors.push_back("train.grad_accum_steps " + std::to_string(was.accum) + " -> " + std::to_string(now.accum));
  }
  if (factors.empty()) return;
  if (was.global == now.global) {
    out.notes.push_back(join(factors, ", ") + ": the global batch stays " + std::to_string(now.global) +
                        " samples, so the steps see the same samples as the saved run's would");
    return;
  }
  out.notes.push_back("global batch " + std::to_string(was.global) + " -> " + std::to_string(now.global) +
                      " samples per step (" + join(factors, ", ") + "): the data continues at sample " +
                      std::to_string(samples_seen) + ", but each step now averages its gradient over " +
                      std::to_string(now.global) +
                      " samples at the same learning rate, and its loss is not "
                      "comparable step for step with the saved run's");
}

}  // namespace

ResumeReview review_resume(const fsdp::checkpoint::TrainState& saved, const std::string& checkpoint,
                           const TrainConfig& config, int world_size) {
  ResumeReview out;
  const json& extra = saved.extra;
  const auto schedule = ScheduleSpec::from_json(extra.is_object() ? extra.value("lr_schedule", json()) : json());
  const auto batch = saved_batch(saved);
  if (!schedule || !batch) {
    out.notes.push_back(
        "warning: " + checkpoint +
        " does not record its run's learning-rate schedule and global batch (extra.lr_schedule, "
        "extra.global_batch, extra.config: an older fsdp-train saved it), so this resume cannot "
        "compare train.steps, the schedule or the global batch with the saved run's; check them by hand");
    return out;
  }
  review_schedule(*schedule, ScheduleSpec::of(config), saved.step, checkpoint, out);
  BatchShape now{world_size, config.data.batch_size_per_rank, config.train.grad_accum_steps, 0};
  now.global = now.world * now.per_rank * now.accum;
  review_batch(*batch, now, saved.samples_seen, out);
  return out;
}

}  // namespace train
