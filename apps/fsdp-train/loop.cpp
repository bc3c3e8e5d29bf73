// The loop of the fsdp-train job: step, evaluate, stop, save (loop.h).
#include "loop.h"

#include <unistd.h>

#include <cstdio>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/tensor.h>

#include "base/file_io.h"
#include "fsdp/memory.h"
#include "fsdp/stop.h"
#include "preemption.h"
#include "schedule.h"
#include "sysinfo/sysinfo.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The bytes of the files under `path`.
int64_t tree_bytes(const std::string& path) {
  if (!fsdp::io::is_dir(path)) return static_cast<int64_t>(fsdp::io::File::open_read(path).size());
  int64_t n = 0;
  for (const auto& name : fsdp::io::list_dir(path)) n += tree_bytes(fsdp::io::join(path, name));
  return n;
}

}  // namespace

Loop::Loop(Session& session)
    : s_(session),
      cfg_(session.cfg()),
      ranks_(session.ranks()),
      t_(session.training()),
      metrics_(ranks_.rank == 0 ? session.flags().metrics : "", /*append=*/!session.start().resumed_from.empty()),
      samples_seen_(session.start().samples_seen) {
  r_.step = session.start().step;
  if (!session.start().resumed_from.empty()) r_.last_saved_step = session.start().step;
}

LoopResult Loop::run() {
  const bool terminal = ranks_.rank == 0 && ::isatty(STDOUT_FILENO);
  progress_ = std::make_unique<Progress>(r_.step, cfg_.train.steps, cfg_.train.log_every, terminal);
  const int64_t first_step = r_.step;
  const bool offloads = cfg_.fsdp.offload.any();
  const bool in_step = !s_.flags().save_dir.empty() && s_.plan().resolved.save_in_step;
  if (cfg_.train.eval_every > 0 && r_.step == 0 && cfg_.train.steps > 0) evaluate();
  const auto start = Clock::now();
  while (r_.step < cfg_.train.steps) {
    if (in_step && save_due(r_.step + 1)) t_.checkpointer->begin_in_step(r_.step + 1, *t_.root, *t_.optim);
    const fsdp::OffloadIo io0 = offloads ? fsdp::offload_io(*t_.root) : fsdp::OffloadIo{};
    train_step();
    // Offload I/O is reported per step after the first (whose execution order is not known yet),
    // the steps' own: saves and evaluations between them are left out.
    if (offloads && r_.step > first_step + 1) {
      const fsdp::OffloadIo d = fsdp::offload_io(*t_.root) - io0;
      fsdp::OffloadIo& sum = r_.offload_io_of_steps;
      sum = {sum.disk_read + d.disk_read, sum.disk_write + d.disk_write, sum.to_device + d.to_device,
             sum.to_host + d.to_host};
    }
    if (r_.stop_signal != 0) {  // agreed with the step's metrics
      stop_on_request();
      return r_;
    }
    if (cfg_.train.eval_every > 0 && r_.step % cfg_.train.eval_every == 0) evaluate();
    if (cfg_.train.save_every > 0 && r_.step % cfg_.train.save_every == 0) save();
  }
  if (cfg_.train.eval_every > 0 && r_.step > first_step && r_.last_eval_step != r_.step) evaluate();
  if (r_.last_saved_step != r_.step) save();  // the end of the run; with --steps 0 the initial weights
  t_.checkpointer->wait();                    // an async save in flight is committed before the report
  progress_->finish();
  r_.train_seconds = seconds_since(start);
  r_.steps_trained = r_.step - first_step;
  return r_;
}

void Loop::train_step() {
  const auto t0 = Clock::now();
  const double lr = t_.sched->lr_at(r_.step);
  t_.sched->apply(*t_.optim, r_.step);
  // Snapshots around the step's own work only: the metrics gather below is not step traffic.
  const auto before = t_.comm->snapshot(), groups_before = t_.comm->made_on_use_snapshot();
  const StepOutcome outcome = t_.stepper->run(samples_seen_, r_.step + 1, t_.tracer.get());
  const auto delta = t_.comm->snapshot() - before;
  const auto groups_delta = t_.comm->made_on_use_snapshot() - groups_before;
  ++r_.step;
  samples_seen_ += ranks_.global_batch;

  fsdp::Tracer::Scope span(t_.tracer.get(), "train::metrics", "train", "");
  RankCounters mine;
  mine.loss = outcome.local_loss;
  mine.allgather_bytes = static_cast<double>(delta.of(fsdp::CollectiveKind::kAllGather).bytes_sent);
  mine.reduce_scatter_bytes = static_cast<double>(delta.of(fsdp::CollectiveKind::kReduceScatter).bytes_sent);
  mine.all_reduce_bytes = static_cast<double>(delta.of(fsdp::CollectiveKind::kAllReduce).bytes_sent);
  mine.group_allgather_bytes = static_cast<double>(groups_delta.of(fsdp::CollectiveKind::kAllGather).bytes_sent);
  mine.comm_wait_s = delta.total_wait_s();
  mine.peak_rss_bytes = static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes());
  mine.peak_rss_forward = static_cast<double>(outcome.phases.peak_forward);
  mine.peak_rss_backward = static_cast<double>(outcome.phases.peak_backward);
  mine.peak_rss_optimizer = static_cast<double>(outcome.phases.peak_optimizer);
  // Every rank's counters and its stop request (preemption.h) travel in one collective, so all
  // learn the global loss and the same stop decision.
  const auto agreed =
      fsdp::agree_on_stop_with(ranks_.dist->world(), fsdp::StopRequest::signal(), mine.values(), "train/metrics");
  r_.stop_signal = agreed.signal;
  StepMetrics m;
  for (const auto& v : agreed.values) m.ranks.push_back(RankCounters::of(v));
  // The mean of equal-sized slices' means is the mean over the global batch.
  for (const auto& r : m.ranks) m.loss += r.loss / static_cast<double>(m.ranks.size());
  m.step = r_.step;
  m.lr = lr;
  m.step_time_s = seconds_since(t0);
  m.tokens_per_s = static_cast<double>(ranks_.global_batch * cfg_.data.seq_len) / m.step_time_s;
  m.skipped = !outcome.stepped;
  m.skipped_steps = t_.stepper->scaler().state().skipped_steps;
  m.loss_scale = t_.stepper->scaler().current_scale();
  m.grad_norm = outcome.grad_norm;
  const PhaseTimes& ph = outcome.phases;
  m.phases = {{"data", ph.data},         {"forward", ph.forward},
              {"backward", ph.backward}, {"check_finite", ph.check_finite},
              {"clip", ph.clip},         {"optimizer", ph.optimizer}};
  r_.last_loss = m.loss;
  last_optimizer_s_ = ph.optimizer;
  if (ranks_.rank == 0) {
    metrics_.step(m);
    progress_->step(m);
    if (m.skipped) progress_->note("step " + std::to_string(r_.step) + " skipped: non-finite loss or gradient");
  }
}

// The mean loss over the same eval_batches global batches of the eval split every time, so
// evaluations are comparable across steps, runs and world sizes.
void Loop::evaluate() {
  fsdp::Tracer::Scope span(t_.tracer.get(), "train::eval", "train", "");
  c10::NoGradGuard no_grad;
  double sum = 0;
  for (int64_t b = 0; b < cfg_.train.eval_batches; ++b) {
    Batch batch =
        rank_batch(s_.data(), b * ranks_.eval_batch, cfg_.data.batch_size_per_rank, ranks_.rank, Split::kEval);
    // The model's loss forward: whole logits or chunked, as train.loss_chunk_tokens says.
    sum += fsdp::call(t_.model, batch.inputs.to(ranks_.device), batch.targets.to(ranks_.device)).item<double>();
  }
  at::Tensor t = at::tensor({sum / static_cast<double>(cfg_.train.eval_batches)}, at::kDouble);
  ranks_.dist->world().all_reduce(t, fsdp::ReduceOp::kAvg, "train/eval_loss").wait();
  r_.last_eval_loss = t.item<double>();
  r_.last_eval_step = r_.step;
  if (ranks_.rank == 0) {
    metrics_.eval(r_.step, r_.last_eval_loss);
    progress_->eval(r_.step, r_.last_eval_loss);
  }
}

bool Loop::save_due(int64_t step) const {
  return (cfg_.train.save_every > 0 && step % cfg_.train.save_every == 0) || step == cfg_.train.steps;
}

// After the step in flight, on every rank: save (with --save-dir), say so, and let the job
// return 128 + signal.
void Loop::stop_on_request() {
  const auto t0 = Clock::now();
  const std::string sig = stop_signal_name(r_.stop_signal);
  progress_->finish();
  if (ranks_.rank == 0) {
    std::fprintf(stderr, "fsdp-train: %s: stopping after step %lld%s\n", sig.c_str(), static_cast<long long>(r_.step),
                 s_.flags().save_dir.empty() ? " (no --save-dir: nothing is saved)" : ", saving a checkpoint first");
  }
  if (r_.last_saved_step != r_.step) save();
  t_.checkpointer->wait();  // an async save is committed before the job stops
  if (ranks_.rank != 0) return;
  std::printf("stopped by %s at step %lld", sig.c_str(), static_cast<long long>(r_.step));
  if (!r_.last_checkpoint.empty()) {
    std::printf(" (saving took %.2f s); resume from %s with --resume latest", seconds_since(t0),
                r_.last_checkpoint.c_str());
  }
  std::printf("\n");
  std::fflush(stdout);
}

void Loop::save() {
  if (s_.flags().save_dir.empty()) return;
  fsdp::Tracer::Scope span(t_.tracer.get(), "train::checkpoint_save", "train", "");
  // What a resume checks (config_hash; Note [Resume changes]) and what fsdp-ckpt export reads.
  nlohmann::json extra = {{"config", cfg_.to_json()},
                          {"config_hash", cfg_.config_hash()},
                          {"lr_schedule", ScheduleSpec::of(cfg_).to_json(r_.step)},
                          {"global_batch", ranks_.global_batch},
                          {"grad_scaler", scaler_json(t_.stepper->scaler())}};
  if (!s_.start().init_from.is_null()) extra["init_from"] = s_.start().init_from;
  const auto t0 = Clock::now();
  // The save's own peak: the step's freed blocks returned first (the save would return them itself,
  // after the watermark had counted them).
  fsdp::release_host_memory();
  fsdp::sysinfo::reset_peak_rss();
  r_.last_checkpoint = t_.checkpointer->save(r_.step, samples_seen_, *t_.root, *t_.optim, extra);
  r_.last_saved_step = r_.step;
  if (t_.checkpointer->async()) {
    if (ranks_.rank == 0) progress_->note("saving checkpoint in the background: " + r_.last_checkpoint);
    return;
  }
  const double seconds = seconds_since(t0);
  RankCounters mine;
  mine.peak_rss_bytes = static_cast<double>(fsdp::sysinfo::peak_rss_bytes());
  const auto all = gather_counters(ranks_.dist->world(), mine);
  // Every rank knows from the config whether saves are written during the step (the collective).
  double in_step_bytes = 0;
  if (s_.plan().resolved.save_in_step) {
    at::Tensor t = at::tensor({static_cast<double>(t_.checkpointer->bytes_written_in_step())}, at::kDouble);
    ranks_.dist->world().all_reduce(t, fsdp::ReduceOp::kSum, "train/save_in_step_bytes").wait();
    in_step_bytes = t.item<double>();
  }
  if (ranks_.rank != 0) return;
  const int64_t bytes = tree_bytes(r_.last_checkpoint);
  std::string line = " in " + format("%.1f", seconds) + " s (" + format("%.1f", static_cast<double>(bytes) / 1e6) +
                     " MB, " + format("%.0f", static_cast<double>(bytes) / 1e6 / seconds) + " MB/s)";
  // A save fused into the step (train.save_in_step): what the step wrote, and how long the step's
  // optimizer phase took with it, for comparison with the steps without a save.
  if (in_step_bytes > 0) {
    line = " in " + format("%.2f", seconds) + " s after the step (" + format("%.1f", static_cast<double>(bytes) / 1e6) +
           " MB, " + format("%.1f", in_step_bytes / 1e6) + " MB of it written during step " + std::to_string(r_.step) +
           "'s optimizer phase, which took " + format("%.2f", last_optimizer_s_) + " s)";
  }
  line += "; peak RSS per rank during the save:";
  for (const auto& r : all) line += " " + format("%.1f", r.peak_rss_bytes / (1 << 20)) + " MiB";
  progress_->note("saved checkpoint " + r_.last_checkpoint + line);
}

}  // namespace train
