// The reports of the fsdp-train job: baseline, header, final (report.h).
#include "report.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "fsdp/memory.h"
#include "fsdp/offload.h"
#include "fsdp/options.h"
#include "sysinfo/sysinfo.h"

namespace train {
namespace {

// --trace FILE on several ranks: each rank writes FILE with ".rankK" before the extension, so ranks
// never share a file (trace.json -> trace.rank1.json).
std::string trace_path(const std::string& path, int rank, int world_size) {
  if (world_size <= 1) return path;
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  const std::string tag = ".rank" + std::to_string(rank);
  return has_ext ? path.substr(0, dot) + tag + path.substr(dot) : path + tag;
}

// "peak RSS per rank: A MiB B MiB", then on CPU runs the plan's peak per rank beside it (RAM).
void print_peak_rss(const char* head, const std::vector<RankCounters>& all, const fsdp::Plan* plan) {
  std::printf("%s", head);
  for (const auto& r : all) std::printf(" %.1f MiB", r.peak_rss_bytes / (1 << 20));
  if (plan != nullptr && plan->host.items.empty()) {
    std::printf("; the plan's peak per rank %.1f MiB (in the %s)", static_cast<double>(plan->peak()) / (1 << 20),
                plan->peak_phase());
  }
  std::printf("\n");
}

// The lines on the model, the data and the optimizer.
void print_run(const Session& s) {
  const TrainConfig& cfg = s.cfg();
  const Ranks& k = s.ranks();
  const auto& m = cfg.model;
  std::printf("fsdp-train: %d rank(s), %s (shard group %d x %d replica(s)), param_dtype %s, reduce_dtype %s\n", k.world,
              fsdp::strategy_name(cfg.fsdp.strategy), k.mesh->shard_size(), k.mesh->replicate_size(),
              dtype_name(cfg.fsdp.param_dtype), dtype_name(cfg.fsdp.reduce_dtype));
  std::printf(
      "model: %s, %lld layers, hidden %lld, heads %lld (kv %lld), vocab %lld: %.3fM params, %s attention "
      "(config_hash %s)\n",
      m.model_type.c_str(), static_cast<long long>(m.num_hidden_layers), static_cast<long long>(m.hidden_size),
      static_cast<long long>(m.num_attention_heads), static_cast<long long>(m.num_key_value_heads),
      static_cast<long long>(m.vocab_size), static_cast<double>(llama::param_counts(m).total(m)) / 1e6,
      m.attn_implementation.c_str(), cfg.config_hash().c_str());
  std::printf("data: %s; seq_len %lld, global batch %lld (%lld per rank) = %lld tokens/step\n",
              s.data().describe().c_str(), static_cast<long long>(cfg.data.seq_len),
              static_cast<long long>(k.global_batch), static_cast<long long>(cfg.data.batch_size_per_rank),
              static_cast<long long>(k.global_batch * cfg.data.seq_len));
  const auto& o = cfg.optim;
  std::printf("optim: AdamW lr %g betas [%g, %g] eps %g weight_decay %g; %s schedule, warmup %lld%s; grad_clip %s%s\n",
              o.lr, o.betas[0], o.betas[1], o.eps, o.weight_decay, name_of(kSchedules, o.schedule),
              static_cast<long long>(o.warmup_steps),
              o.schedule == Schedule::kCosine
                  ? (", min_lr " + format("%g", o.min_lr) + " at step " + std::to_string(cfg.train.steps)).c_str()
                  : "",
              o.grad_clip > 0 ? format("%g", o.grad_clip).c_str() : "off",
              o.step_in_backward ? "; steps in backward" : "");
}

// The lines on offload, checkpoints and where the run starts.
void print_plans(const Session& s) {
  const TrainConfig& cfg = s.cfg();
  const auto& off = cfg.fsdp.offload;
  if (off.any()) {
    std::printf("offload plan per rank: %s\n",
                fsdp::offload_plan(*s.training().root, *s.training().optim).to_string().c_str());
    std::printf("offload: params %s, grads %s, optimizer_state %s%s%s, memory_budget_bytes %lld\n",
                fsdp::offload_tier_name(off.params()), fsdp::offload_tier_name(off.grads()),
                fsdp::offload_tier_name(off.optimizer_state()), off.dir().empty() ? "" : ", dir ", off.dir().c_str(),
                static_cast<long long>(off.memory_budget_bytes()));
  }
  if (s.flags().save_dir.empty()) {
    std::printf("checkpoints: off (pass --save-dir DIR)\n");
  } else {
    std::printf("checkpoints: %s, %s, keep_last %lld\n", s.flags().save_dir.c_str(),
                cfg.train.save_every > 0
                    ? ("every " + std::to_string(cfg.train.save_every) + " steps and at the end").c_str()
                    : "at the end",
                static_cast<long long>(cfg.train.keep_last));
  }
  const StartPoint& start = s.start();
  if (start.started_fresh) {
    std::printf("--resume latest: no checkpoint in %s yet, starting at step 0\n", s.flags().save_dir.c_str());
  }
  if (!start.resumed_from.empty()) {
    std::printf("resumed from %s at step %lld (samples_seen %lld)\n", start.resumed_from.c_str(),
                static_cast<long long>(start.step), static_cast<long long>(start.samples_seen));
  }
  for (const auto& note : start.notes) std::printf("resume: %s\n", note.c_str());
  if (start.step >= cfg.train.steps) {
    std::printf("already at step %lld: nothing to train for --steps %lld\n", static_cast<long long>(start.step),
                static_cast<long long>(cfg.train.steps));
  }
}

// Rank 0's measured cost of each memory lever beside the plan's figure, one line on stdout.
void report_levers(const Session& s, const LoopResult& r) {
  if (!s.plan().plan) return;
  const Training& t = s.training();
  MeasuredLevers got = t.stepper->measured();
  if (t.checkpointer->async() && r.last_saved_step >= 0) got.async_snapshot = t.checkpointer->snapshot_bytes();
  const auto report = lever_report(*s.plan().plan, got);
  if (report.empty()) return;
  std::printf("memory levers, plan vs measured (rank 0):");
  for (const auto& [name, v] : report.items()) {
    std::printf(" %s %.2f vs %.2f MiB (%+.1f%%);", name.c_str(), v["plan"].get<double>() / (1 << 20),
                v["measured"].get<double>() / (1 << 20), 100 * v["error"].get<double>());
  }
  std::printf("\n");
}

void print_outcome(const Session& s, const LoopResult& r) {
  if (r.steps_trained > 0) {
    std::printf("done: %lld steps in %.1f s (%.3f s/step), step %lld, loss %.4f",
                static_cast<long long>(r.steps_trained), r.train_seconds,
                r.train_seconds / static_cast<double>(r.steps_trained), static_cast<long long>(r.step), r.last_loss);
  } else {
    std::printf("done: no steps trained, step %lld", static_cast<long long>(r.step));
  }
  if (r.last_eval_step >= 0) {
    std::printf(", eval loss %.4f, perplexity %.2f (step %lld)", r.last_eval_loss, std::exp(r.last_eval_loss),
                static_cast<long long>(r.last_eval_step));
  }
  const int64_t skipped = s.training().stepper->scaler().state().skipped_steps;
  if (skipped > 0) std::printf(", %lld step(s) skipped (non-finite)", static_cast<long long>(skipped));
}

}  // namespace

void report_baseline(const Session& s) {
  RankCounters mine;
  mine.peak_rss_bytes = static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes());
  const auto all = gather_counters(s.ranks().dist->world(), mine);
  if (s.ranks().rank != 0) return;
  std::printf("fsdp-train: init only, %d rank(s), no model built; ", s.ranks().world);
  print_peak_rss("peak RSS per rank:", all, nullptr);
  std::fflush(stdout);
  if (s.flags().metrics.empty()) return;
  nlohmann::json rss = nlohmann::json::array();
  for (const auto& r : all) rss.push_back(r.peak_rss_bytes);
  std::FILE* f = std::fopen(s.flags().metrics.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("cannot write " + s.flags().metrics);
  std::fprintf(f, "%s\n", nlohmann::json({{"init_only", true}, {"peak_rss_bytes", rss}}).dump().c_str());
  std::fclose(f);
}

void report_header(const Session& s) {
  if (s.ranks().rank != 0) return;
  print_run(s);
  const RunPlan& run = s.plan();
  if (run.plan) std::printf("plan per rank (fsdp/plan.h): %s", run.plan->to_string().c_str());
  if (!run.plan) std::printf("plan: none (train.budget.check false; the planner refused: %s)\n", run.refused.c_str());
  std::printf("%s\n", levers_summary(s.cfg(), run.resolved).c_str());
  print_plans(s);
  std::fflush(stdout);
}

void report_final(const Session& s, const LoopResult& r) {
  const Ranks& k = s.ranks();
  const Training& t = s.training();
  const auto report = fsdp::memory_report(*t.root, t.optim.get());
  const fsdp::DiskTierStats disk = fsdp::disk_tier_stats(*t.root);  // the blocks its files take
  RankCounters mine;
  mine.peak_rss_bytes = static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes());
  const auto all = gather_counters(k.dist->world(), mine);
  if (t.tracer) t.tracer->write(trace_path(s.flags().trace, k.rank, k.world));
  if (k.rank != 0) return;
  print_outcome(s, r);
  std::printf("\nmemory measured (rank 0): %s\n", report.to_string().c_str());
  report_levers(s, r);
  if (s.cfg().fsdp.offload.any() && r.steps_trained > 1) {
    const auto io = r.offload_io_of_steps.per_step(r.steps_trained - 1);
    std::printf("offload measured (rank 0, per step after the first): %s\n", io.to_string().c_str());
  }
  if (disk.file_bytes > 0)
    std::printf("disk tier (rank 0): %.3f MiB on disk under %s\n", disk.file_bytes / 1048576.0, disk.dir.c_str());
  print_peak_rss("peak RSS per rank:", all, s.plan().plan ? &*s.plan().plan : nullptr);
  if (!r.last_checkpoint.empty()) std::printf("checkpoint: %s\n", r.last_checkpoint.c_str());
  if (!s.flags().metrics.empty()) std::printf("metrics: %s\n", s.flags().metrics.c_str());
  if (t.tracer) {
    std::printf("trace: %s%s\n", trace_path(s.flags().trace, 0, k.world).c_str(),
                k.world > 1 ? " (and the other ranks' beside it)" : "");
  }
  std::fflush(stdout);
}

}  // namespace train
