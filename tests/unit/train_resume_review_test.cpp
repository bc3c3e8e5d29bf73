// fsdp-train's review of a resume (apps/fsdp-train/resume_review.h, Note [Resume changes]): each
// change of train.steps, the learning-rate schedule or the global batch against the saved run is
// reported with its effect, a jump of the lr at the resumed step is refused with both values and
// the two ways out, and a checkpoint that lacks the saved run's schedule is resumed with a warning.
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config.h"
#include "fsdp/optim.h"
#include "resume_review.h"
#include "schedule.h"

namespace {

using nlohmann::json;
using train::ResumeReview;
using train::TrainConfig;

TrainConfig config(int64_t steps) {
  TrainConfig c;
  c.train.steps = steps;
  c.optim.lr = 6e-3;
  c.optim.min_lr = 6e-4;
  c.optim.warmup_steps = 10;
  c.data.batch_size_per_rank = 16;
  return c;
}

// The train state fsdp-train saves after `step` steps of `saved` on `world` ranks.
fsdp::checkpoint::TrainState saved_state(const TrainConfig& saved, int64_t step, int world) {
  const int64_t global = saved.data.batch_size_per_rank * world * saved.train.grad_accum_steps;
  fsdp::checkpoint::TrainState state;
  state.step = step;
  state.samples_seen = step * global;
  state.world_size = world;
  state.extra = {{"config", saved.to_json()},
                 {"lr_schedule", train::ScheduleSpec::of(saved).to_json(step)},
                 {"global_batch", global}};
  return state;
}

ResumeReview review(const TrainConfig& saved, int64_t step, int saved_world, const TrainConfig& now, int world) {
  return train::review_resume(saved_state(saved, step, saved_world), "ckpt/step-00000060", now, world);
}

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(TrainResumeReview, AnUnchangedRunHasNothingToSay) {
  const auto r = review(config(120), 60, 2, config(120), 2);
  EXPECT_TRUE(r.notes.empty());
  EXPECT_TRUE(r.lr_jump.empty());
}

TEST(TrainResumeReview, MoreStepsReStretchTheCosineAndTheLrJumpIsRefused) {
  const auto r = review(config(60), 60, 2, config(120), 2);
  const double was = fsdp::WarmupCosine(6e-3, 10, 60, 6e-4).lr_at(60);  // min_lr: the saved run ended
  const double now = fsdp::WarmupCosine(6e-3, 10, 120, 6e-4).lr_at(60);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_EQ(r.notes[0],
            "train.steps 60 -> 120: the cosine schedule is re-stretched to reach min_lr at step 120; "
            "lr at step 61 goes from " +
                fmt(was) + " to " + fmt(now));
  EXPECT_EQ(fmt(was), "0.0006");
  const std::vector<std::string> parts = {"--resume ckpt/step-00000060 at step 60",
                                          "would jump at step 61 from 0.0006",
                                          "to " + fmt(now),
                                          "train.steps 60 -> 120",
                                          "--steps 60",
                                          "--allow-schedule-change"};
  for (const auto& part : parts) {
    EXPECT_TRUE(has(r.lr_jump, part)) << part << " not in: " << r.lr_jump;
  }
}

TEST(TrainResumeReview, ChangesThatKeepTheLrAtTheResumedStepAreReportedNotRefused) {
  // In warmup the lr does not depend on train.steps; later it does, and the note says where.
  auto r = review(config(60), 5, 2, config(120), 2);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_TRUE(r.lr_jump.empty());
  const double later_was = fsdp::WarmupCosine(6e-3, 10, 60, 6e-4).lr_at(119);
  const double later_now = fsdp::WarmupCosine(6e-3, 10, 120, 6e-4).lr_at(119);
  EXPECT_EQ(r.notes[0],
            "train.steps 60 -> 120: the cosine schedule is re-stretched to reach min_lr at step 120; lr at "
            "step 6 stays " +
                fmt(6e-3 * 6 / 10) + "; at step 120 it is " + fmt(later_now) + " instead of " + fmt(later_was));
  // A constant schedule does not depend on train.steps at all.
  auto constant60 = config(60), constant120 = config(120);
  constant60.optim.schedule = constant120.optim.schedule = train::Schedule::kConstant;
  r = review(constant60, 60, 2, constant120, 2);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_TRUE(r.lr_jump.empty());
  EXPECT_EQ(r.notes[0],
            "train.steps 60 -> 120: the constant schedule does not depend on it; lr at step 61 stays 0.006");
}

TEST(TrainResumeReview, ANewPeakLrOrScheduleKindJumpsAndNamesTheFlagsThatRestoreIt) {
  auto lower = config(120);
  lower.optim.lr = 3e-3;
  auto r = review(config(120), 60, 2, lower, 2);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_TRUE(has(r.notes[0], "optim.lr 0.006 -> 0.003: the schedule changes; lr at step 61 goes from ")) << r.notes[0];
  EXPECT_TRUE(has(r.lr_jump, "--set optim.lr=0.006")) << r.lr_jump;
  auto constant = config(120);
  constant.optim.schedule = train::Schedule::kConstant;
  r = review(config(120), 60, 2, constant, 2);
  EXPECT_TRUE(has(r.notes.at(0), "optim.schedule cosine -> constant")) << r.notes[0];
  EXPECT_TRUE(has(r.lr_jump, "--set optim.schedule=cosine")) << r.lr_jump;
  // Nothing left to train: no lr is used, so nothing can jump.
  r = review(config(60), 60, 2, config(50), 2);
  EXPECT_TRUE(r.lr_jump.empty());
  EXPECT_EQ(r.notes.at(0), "train.steps 60 -> 50: the cosine schedule is re-stretched to reach min_lr at step 50");
}

TEST(TrainResumeReview, AnotherGlobalBatchIsReportedWithWhatMadeIt) {
  auto r = review(config(120), 60, 2, config(120), 4);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_TRUE(r.lr_jump.empty());
  EXPECT_TRUE(has(r.notes[0],
                  "global batch 32 -> 64 samples per step (world size 2 -> 4): the data continues at "
                  "sample 1920, but each step now averages its gradient over 64 samples"))
      << r.notes[0];
  auto accum = config(120);
  accum.train.grad_accum_steps = 2;
  accum.data.batch_size_per_rank = 4;
  r = review(config(120), 60, 2, accum, 2);
  EXPECT_TRUE(has(r.notes.at(0),
                  "global batch 32 -> 16 samples per step (data.batch_size_per_rank 16 -> 4, "
                  "train.grad_accum_steps 1 -> 2)"))
      << r.notes[0];
  // Another world size with the same global batch: said, as the steps still see the same samples.
  auto doubled = config(120);
  doubled.data.batch_size_per_rank = 32;
  r = review(config(120), 60, 2, doubled, 1);
  EXPECT_EQ(r.notes.at(0),
            "world size 2 -> 1, data.batch_size_per_rank 16 -> 32: the global batch stays 32 samples, "
            "so the steps see the same samples as the saved run's would");
}

TEST(TrainResumeReview, ACheckpointWithoutTheSavedScheduleResumesWithAWarning) {
  for (const char* key : {"lr_schedule", "global_batch", "config"}) {
    auto state = saved_state(config(60), 60, 2);
    state.extra.erase(key);
    const auto r = train::review_resume(state, "old", config(120), 2);
    EXPECT_TRUE(r.lr_jump.empty()) << key;
    ASSERT_EQ(r.notes.size(), 1u) << key;
    EXPECT_TRUE(has(r.notes[0], "warning: old does not record its run's learning-rate schedule and global batch"))
        << r.notes[0];
  }
  auto state = saved_state(config(60), 60, 2);
  state.extra["lr_schedule"]["total_steps"] = "60";  // a wrong type counts as missing
  EXPECT_TRUE(has(train::review_resume(state, "odd", config(120), 2).notes.at(0), "warning: odd"));
}

}  // namespace
