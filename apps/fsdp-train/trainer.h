// The training job behind fsdp-train, a composition of three parts: the session (session.h: join,
// build, resume), the loop (loop.h: step, evaluate, stop, save) and the reports (report.h: header,
// levers, final).
#pragma once

#include "config.h"
#include "data.h"
#include "flags.h"
#include "hooks.h"
#include "run_plan.h"

namespace train {

// Runs the whole job on this rank; collective. `data` is opened by the caller before the job is
// joined, so a bad file fails at once. Returns 0 on success, or 128 + S when every rank stopped
// after signal S (preemption.h; checkpoint saved with --save-dir), and throws on failure
// (std::invalid_argument for config problems found only once the world size is known). `plan`: the
// choices and the plan made before the job joined (run_plan.h); `hooks`: hooks.h (the installed
// program passes none).
int run_training(const TrainConfig& config, const Flags& flags, const RunPlan& plan, Dataset data,
                 const TrainHooks& hooks);

}  // namespace train
