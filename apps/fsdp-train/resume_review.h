// What a resume changes against the run that saved the checkpoint, and whether to allow it.
//
// Note [Resume changes]
// A resume may change train.steps, the learning-rate schedule (optim.schedule, lr, warmup_steps,
// min_lr) or the global batch (world size x data.batch_size_per_rank x train.grad_accum_steps).
// Each change is reported with its effect, e.g. "train.steps 60 -> 120: the cosine schedule is
// re-stretched to reach min_lr at step 120; lr at step 61 goes from 0.0006 to 0.004134". The saved
// run's schedule comes from the checkpoint (TrainState.extra.lr_schedule), its global batch from
// extra.global_batch, extra.config and the saved world size. When the lr of the first resumed step
// differs from the one the saved run's schedule gives at that step, the resume is refused (on
// every rank, before anything is loaded or written) unless --allow-schedule-change accepts it: a
// jump in the lr usually means a run extended by mistake rather than on purpose. A changed global
// batch alone is reported, not refused (the data continues at samples_seen whatever the batch). A
// checkpoint without those fields resumes with a warning that it cannot be compared.
#pragma once

#include "fsdp/checkpoint.h"

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.h"

namespace train {

struct ResumeReview {
  std::vector<std::string> notes;  // one line per change with its effect, or the older-checkpoint warning
  // Non-empty when the lr jumps at the first resumed step: the whole error, naming the changes, both
  // lrs and the two ways out.
  std::string lr_jump;
};

// saved: the checkpoint's train state (fsdp::checkpoint::read_train_state: its step, world size and
// "extra"); checkpoint: its directory, for the messages; config and world_size: this run's.
ResumeReview review_resume(const fsdp::checkpoint::TrainState& saved, const std::string& checkpoint,
                           const TrainConfig& config, int world_size);

}  // namespace train
