// What the trainer reports: per-step metrics (JSON lines for --metrics, a progress bar or log
// lines on stdout) and the communication counters behind them. The run's plan is run_plan.h.
//
// One --metrics line per step, written by rank 0:
//   {"step": 12, "loss": 2.31, "lr": 0.003, "step_time_s": 0.21, "tokens_per_s": 4876.2,
//    "allgather_bytes": [r0, r1, ...], "reduce_scatter_bytes": [...], "all_reduce_bytes": [...],
//    "comm_wait_s": [...], ["group_allgather_bytes": [...] with fsdp.reshard_after_forward_group,]
//    "peak_rss_bytes": [...], "skipped": false, "skipped_steps": 0, "loss_scale": 1.0[, "grad_norm": 0.8]}
// and one per evaluation: {"eval": true, "step": 50, "loss": 1.93, "perplexity": 6.89}. "step" counts optimizer steps
// taken (the first training line is step 1); "loss" is the mean over the global batch; the arrays
// are indexed by rank; bytes are those the rank sent during the step's forward, backward and
// optimizer step, summed over the mesh's communicators.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include "fsdp/comm.h"
#include "fsdp/device_mesh.h"

namespace train {

// One rank's numbers for one step.
struct RankCounters {
  double loss = 0;  // mean over this rank's slice
  double allgather_bytes = 0;
  double reduce_scatter_bytes = 0;
  double all_reduce_bytes = 0;  // the replicas' gradient all-reduce (HYBRID_SHARD, NO_SHARD) and small ones
  // Of allgather_bytes, what backward's gathers sent inside the post-forward groups
  // (fsdp.reshard_after_forward_group); the rest crossed the whole shard group.
  double group_allgather_bytes = 0;
  double comm_wait_s = 0;
  double peak_rss_bytes = 0;
  // The step's peaks by phase (fsdp::sysinfo::peak_rss_bytes): the forward, the backward, and the rest (checks,
  // clipping, the optimizer step).
  double peak_rss_forward = 0, peak_rss_backward = 0, peak_rss_optimizer = 0;

  // As a flat list and back, to travel in a collective (fsdp::agree_on_stop_with).
  std::vector<double> values() const;
  static RankCounters of(const std::vector<double>& values);
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;  // mean over the global batch
  double lr = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;    // global
  bool skipped = false;       // non-finite loss or gradient: no update on any rank
  int64_t skipped_steps = 0;  // so far in the run (this process)
  double loss_scale = 1;      // after this step (1 without loss scaling)
  double grad_norm = -1;      // before clipping; -1 when not clipping or skipped
  // Seconds of the writing rank's step per part ("data", "forward", "backward", "check_finite",
  // "clip", "optimizer"); the rest of step_time_s is the metrics' own gather.
  std::vector<std::pair<std::string, double>> phases;
  std::vector<RankCounters> ranks;
};

// Gathers every rank's counters with one all_gather (so every rank learns the global loss).
std::vector<RankCounters> gather_counters(fsdp::Communicator& world, const RankCounters& mine);

// The sum of the stats of every distinct communicator a mesh uses (world, shard and replicate
// groups), so HYBRID_SHARD's row and column traffic is counted too.
class CommCounter {
 public:
  explicit CommCounter(fsdp::DeviceMesh& mesh);
  fsdp::CommStats snapshot() const;
  // Of snapshot(), the groups the mesh made on first use (post-forward groups, replicated params).
  fsdp::CommStats made_on_use_snapshot() const;

 private:
  static fsdp::CommStats sum(const std::vector<fsdp::Communicator*>& comms);
  std::vector<fsdp::Communicator*> comms_, made_on_use_;
};

// One printf conversion of a double ("%.1f", "%g%%") as a string.
std::string format(const char* conversion, double x);

// The --metrics file. Writes nothing when constructed with an empty path (and on ranks other than
// 0, whose caller passes ""). Each line is flushed, so a crashed run keeps its history.
class MetricsLog {
 public:
  MetricsLog(const std::string& path, bool append);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void step(const StepMetrics& m);
  void eval(int64_t step, double loss);

 private:
  std::FILE* file_ = nullptr;
};

// Rank 0's stdout: on a terminal, one progress line redrawn with '\r' (step/total, loss, tokens/s,
// ETA); otherwise a plain line every `log_every` steps and at the last step.
class Progress {
 public:
  Progress(int64_t first_step, int64_t total_steps, int64_t log_every, bool terminal);
  void step(const StepMetrics& m);
  void eval(int64_t step, double loss);
  void note(const std::string& line);  // prints a full line without garbling the bar
  void finish();

 private:
  std::string eta(int64_t step) const;
  int64_t first_step_, total_steps_, log_every_;
  bool terminal_;
  bool bar_drawn_ = false;
  double elapsed_s_ = 0;  // sum of step times since first_step_
};

}  // namespace train
