// What the fsdp-train job prints (rank 0, stdout): the baseline of --init-only, the header before
// the first step (config summary, memory and offload plans, levers, checkpoints, the resume), and
// the final report (losses, measured memory beside the plan, offload I/O, peak RSS, files).
#pragma once

#include "loop.h"
#include "memory_plan.h"
#include "session.h"

namespace train {

// --init-only: each rank's peak RSS with the libraries loaded, the data open and the job joined,
// before any model exists (bench/compare.py subtracts it from a run's peak). Collective.
void report_baseline(Session& s);

// The header, after build() and resume(); prints on rank 0 only.
void report_header(Session& s);

// The end of a run that was not stopped: the measured report and where the files are; also
// writes the trace (every rank). Collective.
void report_final(Session& s, const LoopResult& r);

// The start-of-run memory plan per rank.
MemoryPlan memory_plan(const Session& s);

}  // namespace train
