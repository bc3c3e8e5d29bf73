// The training job behind fsdp-train: builds the sharded Llama from a TrainConfig, then runs the
// step loop (schedule, forward, backward, clip, step), evaluation, metrics and checkpoints.
#pragma once

#include <string>

#include "config.h"
#include "data.h"
#include "flags.h"

namespace train {

// Checks for config values this build accepts but cannot honour yet, and fails loudly rather than
// quietly training without them (std::invalid_argument naming the key). Call before joining the job.
void check_supported(const TrainConfig& config);

// Runs the whole job on this rank; collective. `data` is opened by the caller before the job is
// joined, so a bad file fails at once. Returns 0 on success, or 128 + S when every rank stopped
// after signal S (preemption.h; checkpoint saved with --save-dir), and throws on failure
// (std::invalid_argument for config problems found only once the world size is known).
int run_training(const TrainConfig& config, const Flags& flags, Dataset data);

}  // namespace train
