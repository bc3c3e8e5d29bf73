// What the fsdp-train job prints (rank 0, stdout): the baseline of --init-only, the header before
// the first step (config summary, the run's plan and the offload plan, levers, checkpoints, the
// resume), and the final report (losses, measured memory, each lever beside the plan's items,
// offload I/O, peak RSS, files).
#pragma once

#include "loop.h"
#include "run_plan.h"
#include "session.h"

namespace train {

// --init-only: each rank's peak RSS with the libraries loaded, the data open and the job joined,
// before any model exists (bench/compare.py subtracts it from a run's peak). Collective.
void report_baseline(const Session& s);

// The header, after build() and resume(); prints on rank 0 only.
void report_header(const Session& s);

// The end of a run that was not stopped: the measured report and where the files are; also
// writes the trace (every rank). Collective.
void report_final(const Session& s, const LoopResult& r);

}  // namespace train
