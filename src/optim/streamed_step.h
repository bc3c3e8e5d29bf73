// The optimizer step over disk-tier tensors: each flat param's update applied chunk by chunk on
// host buffers that the disk tier's I/O threads fill ahead of use and write back behind it, so
// the step never holds more than memory_budget_bytes of disk-tier state, the reads of the next
// chunks (the next flat param's included) overlap the current chunk's arithmetic, and the writes
// overlap the chunks after them (Note [Disk tier I/O threads] in offload/disk_tier.h). Each chunk
// runs the optimizer's own step_shard on views, so the arithmetic is the optimizer's, unchanged.
//
// Note [Bitwise-equal chunks]
// ATen's element-wise CPU kernels run a vectorised loop over blocks of 2 x Vectorized<float>::size()
// elements (16 with AVX2, 32 with AVX-512) and a scalar loop over the rest. A chunk that starts at
// a multiple of 64 elements and, unless it is the last, spans a multiple of 64 puts every element
// in the same kind of loop as the whole-tensor op does, so the streamed step equals the
// whole-tensor step bit for bit (fp32; one intra-op thread, or kernels whose vector and scalar
// paths agree, as AdamW's and SGD's do). Chunks here are multiples of 1024 elements.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/optim.h"
#include "offload/tier_tensors.h"

namespace fsdp {
class Tracer;
}

namespace fsdp::offload {

using ShardStepFn = std::function<void(ShardState& chunk, at::Tensor& param, const at::Tensor& grad)>;

// One flat param's part of an optimizer step.
struct StepJob {
  ShardState* state = nullptr;
  at::Tensor param;  // the fp32 master shard, in its tier
  // Optional: the master's current values already in host memory (the whole shard, page-aligned;
  // e.g. what the unit's backward all-gather read). The step then updates it in place and writes
  // it back instead of reading the master again.
  at::Tensor param_values;
  bool grad_on_disk = false;  // the gradient shard lives in the disk tier
  // Collects the flat param's gradient and returns what the step reads (host memory), undefined
  // when the flat param has none yet (then it is skipped). Runs right before the flat's first chunk.
  std::function<at::Tensor()> prepare;
  ShardStepFn step;
  // Optional: elements [a, b) of the master were updated; `updated` holds their new values.
  std::function<void(int64_t a, int64_t b, const at::Tensor& updated)> after;
  // Optional: elements [a, b) stepped; the master's and the states' new values, before they are
  // written back (ShardedOptimizer::observe_next_step).
  std::function<void(const ShardState& state, int64_t a, int64_t b, const at::Tensor& master,
                     const std::map<std::string, at::Tensor>& states)>
      observe;
  // Set by prefetch_first_chunk: the reads of elements [0, first_end), by state name ("" for
  // the master), which the step uses instead of reading them again.
  std::vector<std::pair<std::string, IoTicket>> first_reads;
  int64_t first_end = 0;
};

// Issues the disk reads of the job's first chunk now, when they fit in the budget without waiting
// (otherwise, or when the step will refuse the job, it does nothing): for a job queued behind
// others, so that the disk keeps reading while they step.
void prefetch_first_chunk(StepJob& job);

// Whether any of the step's tensors (master, gradient, state) lives in the disk tier.
bool needs_streaming(const StepJob& job);

struct RunOptions {
  // Wait for the step's writes at the end (else they stay queued: a later flush or a read of the
  // same range waits for them).
  bool flush = true;
  // Mark every master read issued before the step as stale (DiskTier::generation). A step of a
  // single flat param whose pending reads are known not to overlap it leaves them valid.
  bool bump_generation = true;
};

// Runs the jobs in order: jobs with disk-tier tensors chunk by chunk through the tier's I/O
// threads, the others whole. Throws ConfigError before anything steps when a state tensor does
// not exist yet (it cannot stream) or the budget is below a unit's working set, and when `step`
// replaces a state tensor instead of updating it in place; OffloadError when a transfer fails.
// Waits for disk reads show on `tracer` (may be null) as fsdp::disk_read_wait.
void run_step(std::vector<StepJob>& jobs, Tracer* tracer = nullptr, RunOptions options = {});

}  // namespace fsdp::offload
