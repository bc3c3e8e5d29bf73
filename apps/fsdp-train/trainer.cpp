// The fsdp-train job: model construction and sharding, the step loop, evaluation, checkpoints and
// the start and end reports. Only rank 0 prints (besides errors) and writes metrics.
#include "trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/ops/tensor.h>
#include <nlohmann/json.hpp>

#include "checkpointing.h"
#include "data.h"
#include "init_from.h"
#include "fsdp/device_mesh.h"
#include "fsdp/dist.h"
#include "fsdp/fully_shard.h"
#include "fsdp/init.h"
#include "fsdp/memory.h"
#include "fsdp/offload.h"
#include "fsdp/optim.h"
#include "fsdp/options.h"
#include "fsdp/stop.h"
#include "fsdp/trace.h"
#include "llama.h"
#include "memory_plan.h"
#include "metrics.h"
#include "preemption.h"
#include "resume_review.h"
#include "schedule.h"
#include "step.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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

std::string fmt(const char* format, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

class Job {
 public:
  Job(const TrainConfig& config, const Flags& flags, Dataset data)
      : cfg_(config), flags_(flags), data_(std::move(data)) {}

  // 0, or 128 + the signal the job stopped on (see preemption.h).
  int run() {
    join();
    if (flags_.init_only) {
      report_baseline();
      return 0;
    }
    build();
    resume_if_asked();
    reserve_offloaded_state();
    print_header();
    loop();
    if (stop_signal_ != 0) return 128 + stop_signal_;
    finish();
    return 0;
  }

 private:
  // fsdp.device=cuda: this rank computes on CUDA device LOCAL_RANK, made current before the
  // process group exists (NCCL binds to it).
  static void use_local_gpu() {
    const auto& hooks = at::detail::getCUDAHooks();
    const int gpus = hooks.hasCUDA() ? hooks.getNumGPUs() : 0;
    const int local = fsdp::parse_dist_env().local_rank;
    if (local >= gpus) {
      throw std::invalid_argument("config: fsdp.device=cuda: local rank " + std::to_string(local) +
                                  " needs CUDA device " + std::to_string(local) + " but this process sees " +
                                  std::to_string(gpus));
    }
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local)));
  }

  // The process group and the mesh: everything a run has before its model.
  void join() {
    if (cfg_.fsdp.device == "cuda") use_local_gpu();
    dist_ =
        fsdp::init_from_env(fsdp::InitOptions()
                                .timeout(std::chrono::milliseconds(static_cast<int64_t>(cfg_.fsdp.timeout_s * 1000)))
                                .device(cfg_.fsdp.device)
                                .check_collectives(cfg_.fsdp.check_collectives));
    device_ = dist_->compute_device();
    rank_ = dist_->rank();
    world_ = dist_->world_size();
    const bool hybrid = cfg_.fsdp.strategy == fsdp::ShardingStrategy::kHybridShard;
    if (hybrid) {
      const int64_t r = cfg_.fsdp.replicate;
      if (r > world_ || world_ % r != 0) {
        throw std::invalid_argument("config: fsdp.replicate=" + std::to_string(r) + ": must divide the world size " +
                                    std::to_string(world_) + " (HYBRID_SHARD replicates over that many rows of ranks)");
      }
      mesh_ = std::make_unique<fsdp::DeviceMesh>(dist_, static_cast<int>(r), world_ / static_cast<int>(r));
    } else {
      mesh_ = std::make_unique<fsdp::DeviceMesh>(dist_);
    }
    shard_size_ = cfg_.fsdp.strategy == fsdp::ShardingStrategy::kNoShard ? 1 : mesh_->shard_size();
    eval_batch_ = cfg_.data.batch_size_per_rank * world_;
    global_batch_ = eval_batch_ * cfg_.train.grad_accum_steps;
  }

  // --init-only: each rank's peak RSS with the libraries loaded, the data open and the job joined,
  // before any model exists (bench/compare.py subtracts it from a run's peak).
  void report_baseline() {
    RankCounters mine;
    mine.peak_rss_bytes = static_cast<double>(peak_rss_bytes());
    const auto all = gather_counters(dist_->world(), mine);
    if (rank_ != 0) return;
    std::printf("fsdp-train: init only, %d rank(s), no model built; peak RSS per rank:", world_);
    for (const auto& r : all) std::printf(" %.1f MiB", r.peak_rss_bytes / (1 << 20));
    std::printf("\n");
    std::fflush(stdout);
    if (flags_.metrics.empty()) return;
    nlohmann::json rss = nlohmann::json::array();
    for (const auto& r : all) rss.push_back(r.peak_rss_bytes);
    std::FILE* f = std::fopen(flags_.metrics.c_str(), "w");
    if (f == nullptr) throw std::runtime_error("cannot write " + flags_.metrics);
    std::fprintf(f, "%s\n", nlohmann::json({{"init_only", true}, {"peak_rss_bytes", rss}}).dump().c_str());
    std::fclose(f);
  }

  void build() {
    // Built on the meta device: no rank ever holds the whole model; each materialises its shards
    // on the first forward from llama_init_fn, which gives the same values whatever the world size.
    model_ = llama::LlamaForCausalLM(cfg_.model, at::kMeta);
    // --init-from: the shards start at zero (cheap) and the import overwrites them, unless a
    // checkpoint is resumed (--resume latest with none saved yet starts fresh: from the import).
    started_fresh_ = flags_.resume == "latest" && !any_checkpoint_saved();  // asked once: a collective
    const bool resuming = !flags_.resume.empty() && !started_fresh_;
    const bool import = !flags_.init_from.empty() && !resuming;
    auto opts = fsdp::FullyShardOptions()
                    .strategy(cfg_.fsdp.strategy)
                    .prefetch_depth(static_cast<int>(cfg_.fsdp.prefetch_depth))
                    .init(import ? fsdp::init::constant(0.0) : llama::llama_init_fn(cfg_.model, cfg_.train.seed));
    const bool mixed = cfg_.fsdp.param_dtype != at::kFloat;
    if (mixed) opts.mp_policy().param_dtype(cfg_.fsdp.param_dtype);
    if (mixed || cfg_.fsdp.reduce_dtype != at::kFloat) opts.mp_policy().reduce_dtype(cfg_.fsdp.reduce_dtype);
    for (auto& layer : model_->model->layers) fsdp::fully_shard(layer, *mesh_, opts);
    auto root_opts = opts;
    // The loss is computed in fp32 whatever the compute dtype.
    if (mixed) root_opts.mp_policy().output_dtype(at::kFloat);
    // Offload is set on the root; the layers inherit it (their own policy is unset).
    const auto& off = cfg_.fsdp.offload;
    root_opts.offload(fsdp::OffloadPolicy()
                          .params(fsdp::parse_offload_tier(off.params))
                          .grads(fsdp::parse_offload_tier(off.grads))
                          .optimizer_state(fsdp::parse_offload_tier(off.optimizer_state))
                          .dir(off.dir)
                          .memory_budget_bytes(off.memory_budget_bytes));
    root_ = fsdp::fully_shard(model_, *mesh_, root_opts);
    if (import) init_from_ = import_hf_weights(flags_.init_from, *root_, rank_, cfg_.model.vocab_size);
    model_->model->checkpoint_every = cfg_.train.activation_checkpointing;

    const auto& o = cfg_.optim;
    optim_ = std::make_unique<fsdp::AdamW>(
        root_, fsdp::AdamWOptions(o.lr).beta1(o.betas[0]).beta2(o.betas[1]).eps(o.eps).weight_decay(o.weight_decay));
    optim_->step_in_backward(o.step_in_backward);
    sched_ = make_schedule(ScheduleSpec::of(cfg_));
    stepper_ = std::make_unique<Stepper>(cfg_, data_, model_, root_, *optim_, device_, rank_);
    checkpointer_ = std::make_unique<Checkpointer>(flags_.save_dir, cfg_.train.async_save, cfg_.train.keep_last);
    comm_ = std::make_unique<CommCounter>(*mesh_);
    if (!flags_.trace.empty()) {
      // The library's own spans (gathers, reductions, waits, optimizer step) land in the same trace
      // as the trainer's phases, which go on their own lane, "train".
      tracer_ = std::make_shared<fsdp::Tracer>(rank_);
      root_->set_tracer(tracer_);
    }
  }

  void resume_if_asked() {
    if (flags_.resume.empty()) return;
    if (started_fresh_) return;  // --resume latest with nothing saved yet (build() asked)
    fsdp::Tracer::Scope span(tracer_.get(), "train::checkpoint_load", "train", "");
    const std::string dir = fsdp::checkpoint::resolve(flags_.save_dir, flags_.resume);
    review_changes(dir);  // before loading: a refused resume reads and writes nothing more
    const auto p = load_checkpoint(flags_.save_dir, dir, *root_, *optim_, cfg_.config_hash());
    step_ = p.step;
    samples_seen_ = p.samples_seen;
    last_saved_step_ = p.step;
    resumed_from_ = p.dir;
    restore_scaler(stepper_->scaler(), p.extra);
    // The checkpoint's weights came from its own --init-from (recorded for fsdp-ckpt export).
    if (p.extra.contains("init_from")) init_from_ = p.extra["init_from"];
    else if (!flags_.init_from.empty()) init_from_ = init_from_record(flags_.init_from, cfg_.model.vocab_size);
  }

  // Note [Resume changes]: the same decision on every rank, from the same train_state.json.
  void review_changes(const std::string& dir) {
    const ResumeReview review = review_resume(fsdp::checkpoint::read_train_state(dir), dir, cfg_, world_);
    if (!review.lr_jump.empty() && !flags_.allow_schedule_change) throw std::invalid_argument(review.lr_jump);
    resume_notes_ = review.notes;
    if (!review.lr_jump.empty()) resume_notes_.push_back("the lr change is accepted (--allow-schedule-change)");
  }

  // --resume latest before the first save (a restarted job that never got that far, or a job
  // script that always passes it) starts from step 0. Every rank must see the same directory.
  bool any_checkpoint_saved() {
    const std::string latest = flags_.save_dir + "/latest";
    at::Tensor seen = at::full({1}, ::access(latest.c_str(), F_OK) == 0 ? 1.0 : 0.0, at::kDouble);
    dist_->world().all_reduce(seen, fsdp::ReduceOp::kSum, "train/resume_latest").wait();
    const int n = static_cast<int>(seen.item<double>());
    if (n != 0 && n != world_) {
      throw std::runtime_error("--resume latest: " + std::to_string(n) + " of " + std::to_string(world_) +
                               " ranks see " + latest +
                               "; every rank needs the same --save-dir (a shared file system)");
    }
    return n == world_;
  }

  // With offloaded optimizer state, its files are created now: a full or unwritable offload.dir
  // fails before the first step rather than at it.
  void reserve_offloaded_state() {
    if (cfg_.fsdp.offload.optimizer_state == "none") return;
    for (auto& s : optim_->states()) optim_->ensure_state(s);
  }

  void print_header() {
    metrics_ = std::make_unique<MetricsLog>(rank_ == 0 ? flags_.metrics : "", /*append=*/!resumed_from_.empty());
    if (rank_ != 0) return;
    const auto& m = cfg_.model;
    const auto& off = cfg_.fsdp.offload;
    const auto plan = memory_plan();
    std::printf("fsdp-train: %d rank(s), %s (shard group %d x %d replica(s)), param_dtype %s, reduce_dtype %s\n",
                world_, fsdp::strategy_name(cfg_.fsdp.strategy), mesh_->shard_size(), mesh_->replicate_size(),
                dtype_name(cfg_.fsdp.param_dtype), dtype_name(cfg_.fsdp.reduce_dtype));
    std::printf(
        "model: %s, %lld layers, hidden %lld, heads %lld (kv %lld), vocab %lld: %.3fM params, %s attention "
        "(config_hash %s)\n",
        m.model_type.c_str(), static_cast<long long>(m.num_hidden_layers), static_cast<long long>(m.hidden_size),
        static_cast<long long>(m.num_attention_heads), static_cast<long long>(m.num_key_value_heads),
        static_cast<long long>(m.vocab_size), static_cast<double>(plan.num_params) / 1e6, m.attn_implementation.c_str(),
        cfg_.config_hash().c_str());
    std::printf("data: %s; seq_len %lld, global batch %lld (%lld per rank) = %lld tokens/step\n",
                data_.describe().c_str(), static_cast<long long>(cfg_.data.seq_len),
                static_cast<long long>(global_batch_), static_cast<long long>(cfg_.data.batch_size_per_rank),
                static_cast<long long>(global_batch_ * cfg_.data.seq_len));
    const auto& o = cfg_.optim;
    std::printf(
        "optim: AdamW lr %g betas [%g, %g] eps %g weight_decay %g; %s schedule, warmup %lld%s; grad_clip %s%s\n", o.lr,
        o.betas[0], o.betas[1], o.eps, o.weight_decay, o.schedule.c_str(), static_cast<long long>(o.warmup_steps),
        o.schedule == "cosine"
            ? (", min_lr " + fmt("%g", o.min_lr) + " at step " + std::to_string(cfg_.train.steps)).c_str()
            : "",
        o.grad_clip > 0 ? fmt("%g", o.grad_clip).c_str() : "off", o.step_in_backward ? "; steps in backward" : "");
    std::printf("memory plan per rank: %s\n", plan.to_string().c_str());
    std::printf("%s\n", levers_summary(cfg_, global_batch_).c_str());
    if (offloads()) std::printf("offload plan per rank: %s\n", fsdp::offload_plan(*root_, *optim_).to_string().c_str());
    if (offloads()) {
      std::printf("offload: params %s, grads %s, optimizer_state %s%s%s, memory_budget_bytes %lld\n",
                  off.params.c_str(), off.grads.c_str(), off.optimizer_state.c_str(), off.dir.empty() ? "" : ", dir ",
                  off.dir.c_str(), static_cast<long long>(off.memory_budget_bytes));
    }
    if (flags_.save_dir.empty()) {
      std::printf("checkpoints: off (pass --save-dir DIR)\n");
    } else {
      std::printf("checkpoints: %s, %s, keep_last %lld\n", flags_.save_dir.c_str(),
                  cfg_.train.save_every > 0
                      ? ("every " + std::to_string(cfg_.train.save_every) + " steps and at the end").c_str()
                      : "at the end",
                  static_cast<long long>(cfg_.train.keep_last));
    }
    if (started_fresh_)
      std::printf("--resume latest: no checkpoint in %s yet, starting at step 0\n", flags_.save_dir.c_str());
    if (!resumed_from_.empty()) {
      std::printf("resumed from %s at step %lld (samples_seen %lld)\n", resumed_from_.c_str(),
                  static_cast<long long>(step_), static_cast<long long>(samples_seen_));
    }
    for (const auto& note : resume_notes_) std::printf("resume: %s\n", note.c_str());
    if (step_ >= cfg_.train.steps) {
      std::printf("already at step %lld: nothing to train for --steps %lld\n", static_cast<long long>(step_),
                  static_cast<long long>(cfg_.train.steps));
    }
    std::fflush(stdout);
  }

  void loop() {
    const bool terminal = rank_ == 0 && ::isatty(STDOUT_FILENO);
    progress_ = std::make_unique<Progress>(step_, cfg_.train.steps, cfg_.train.log_every, terminal);
    const int64_t first_step = step_;
    if (cfg_.train.eval_every > 0 && step_ == 0 && cfg_.train.steps > 0) evaluate();
    const auto start = Clock::now();
    while (step_ < cfg_.train.steps) {
      train_step();
      // Offload I/O is reported per step after the first (whose execution order is not known yet).
      if (offloads() && step_ == first_step + 1) offload_io_after_first_ = fsdp::offload_io(*root_);
      if (stop_signal_ != 0) {  // agreed in train_step's counters gather
        stop_on_request();
        return;
      }
      if (cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0) evaluate();
      if (cfg_.train.save_every > 0 && step_ % cfg_.train.save_every == 0) save();
    }
    if (cfg_.train.eval_every > 0 && step_ > first_step && last_eval_step_ != step_) evaluate();
    if (last_saved_step_ != step_) save();  // the end of the run; with --steps 0 the initial weights
    checkpointer_->wait();                  // an async save in flight is committed before the report
    progress_->finish();
    train_seconds_ = seconds_since(start);
    steps_trained_ = step_ - first_step;
  }

  void train_step() {
    const auto t0 = Clock::now();
    const double lr = sched_->lr_at(step_);
    sched_->apply(*optim_, step_);
    // Snapshots around the step's own work only: the metrics gather below is not step traffic.
    const auto before = comm_->snapshot();
    const StepOutcome outcome = stepper_->run(samples_seen_, step_ + 1, tracer_.get());
    const auto delta = comm_->snapshot() - before;
    ++step_;
    samples_seen_ += global_batch_;

    fsdp::Tracer::Scope s(tracer_.get(), "train::metrics", "train", "");
    RankCounters mine;
    mine.loss = outcome.local_loss;
    mine.allgather_bytes = static_cast<double>(delta.of(fsdp::CollectiveKind::kAllGather).bytes_sent);
    mine.reduce_scatter_bytes = static_cast<double>(delta.of(fsdp::CollectiveKind::kReduceScatter).bytes_sent);
    mine.comm_wait_s = delta.total_wait_s();
    mine.peak_rss_bytes = static_cast<double>(peak_rss_bytes());
    mine.stop_signal = fsdp::StopRequest::signal();
    StepMetrics m;
    m.ranks = gather_counters(dist_->world(), mine);
    // Every rank brought its own stop request (preemption.h) in the gather, so all learn the same
    // answer, as fsdp::agree_on_stop gives it (the lowest rank's signal), with no collective of its own.
    for (const auto& r : m.ranks) {
      if (r.stop_signal != 0) {
        stop_signal_ = static_cast<int>(r.stop_signal);
        break;
      }
    }
    // The mean of equal-sized slices' means is the mean over the global batch.
    for (const auto& r : m.ranks) m.loss += r.loss / static_cast<double>(m.ranks.size());
    m.step = step_;
    m.lr = lr;
    m.step_time_s = seconds_since(t0);
    m.tokens_per_s = static_cast<double>(global_batch_ * cfg_.data.seq_len) / m.step_time_s;
    m.skipped = !outcome.stepped;
    m.skipped_steps = stepper_->scaler().state().skipped_steps;
    m.loss_scale = stepper_->scaler().current_scale();
    m.grad_norm = outcome.grad_norm;
    last_loss_ = m.loss;
    if (rank_ == 0) {
      metrics_->step(m);
      progress_->step(m);
      if (m.skipped) progress_->note("step " + std::to_string(step_) + " skipped: non-finite loss or gradient");
    }
  }

  // The mean loss over the same eval_batches global batches of the eval split every time, so
  // evaluations are comparable across steps, runs and world sizes.
  void evaluate() {
    fsdp::Tracer::Scope span(tracer_.get(), "train::eval", "train", "");
    c10::NoGradGuard no_grad;
    double sum = 0;
    for (int64_t b = 0; b < cfg_.train.eval_batches; ++b) {
      Batch batch = rank_batch(data_, b * eval_batch_, cfg_.data.batch_size_per_rank, rank_, Split::kEval);
      sum += llama::loss(fsdp::call(model_, batch.inputs.to(device_)), batch.targets.to(device_)).item<double>();
    }
    at::Tensor t = at::tensor({sum / static_cast<double>(cfg_.train.eval_batches)}, at::kDouble);
    dist_->world().all_reduce(t, fsdp::ReduceOp::kAvg, "train/eval_loss").wait();
    last_eval_loss_ = t.item<double>();
    last_eval_step_ = step_;
    if (rank_ == 0) {
      metrics_->eval(step_, last_eval_loss_);
      progress_->eval(step_, last_eval_loss_);
    }
  }

  // After the step in flight, on every rank: save (with --save-dir), say so, and let run() return
  // 128 + signal.
  void stop_on_request() {
    const auto t0 = Clock::now();
    const std::string sig = stop_signal_name(stop_signal_);
    progress_->finish();
    if (rank_ == 0) {
      std::fprintf(stderr, "fsdp-train: %s: stopping after step %lld%s\n", sig.c_str(), static_cast<long long>(step_),
                   flags_.save_dir.empty() ? " (no --save-dir: nothing is saved)" : ", saving a checkpoint first");
    }
    if (last_saved_step_ != step_) save(stop_save_pause_s());
    checkpointer_->wait();  // an async save is committed before the job stops
    if (rank_ != 0) return;
    std::printf("stopped by %s at step %lld", sig.c_str(), static_cast<long long>(step_));
    if (!last_checkpoint_.empty()) {
      std::printf(" (saving took %.2f s); resume from %s with --resume latest", seconds_since(t0),
                  last_checkpoint_.c_str());
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  // pause_s: see stop_save_pause_s (a test hook; 0 otherwise).
  void save(double pause_s = 0) {
    if (flags_.save_dir.empty()) return;
    fsdp::Tracer::Scope span(tracer_.get(), "train::checkpoint_save", "train", "");
    // What a resume checks (config_hash; Note [Resume changes]) and what fsdp-ckpt export reads.
    nlohmann::json extra = {{"config", cfg_.to_json()},
                            {"config_hash", cfg_.config_hash()},
                            {"lr_schedule", ScheduleSpec::of(cfg_).to_json(step_)},
                            {"global_batch", global_batch_},
                            {"grad_scaler", scaler_json(stepper_->scaler())}};
    if (!init_from_.is_null()) extra["init_from"] = init_from_;
    std::function<void(const std::string&)> on_phase;
    if (pause_s > 0) {
      on_phase = [this, pause_s](const std::string& phase) {
        if (phase != "commit") return;
        if (rank_ == 0) std::fprintf(stderr, "fsdp-train: test hook: pausing %g s before the commit\n", pause_s);
        std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
      };
    }
    last_checkpoint_ = checkpointer_->save(step_, samples_seen_, *root_, *optim_, extra, on_phase);
    last_saved_step_ = step_;
    if (rank_ == 0) {
      progress_->note((checkpointer_->async() ? "saving checkpoint in the background: " : "saved checkpoint ") +
                      last_checkpoint_);
    }
  }

  MemoryPlan memory_plan() const {
    const auto& off = cfg_.fsdp.offload;
    PlanInputs in;
    in.model = cfg_.model;
    in.param_dtype = cfg_.fsdp.param_dtype;
    in.shard_size = shard_size_;
    in.offload_tiers = {off.params, off.grads, off.optimizer_state};
    in.micro_batch = cfg_.data.batch_size_per_rank;
    in.seq_len = cfg_.data.seq_len;
    in.checkpoint_every = cfg_.train.activation_checkpointing;
    in.grad_accum_steps = cfg_.train.grad_accum_steps;
    in.async_save = cfg_.train.async_save && !flags_.save_dir.empty();
    return plan_memory(in);
  }

  // Rank 0's measured cost of each memory lever beside the plan's figure, one line on stdout.
  void report_levers() {
    MeasuredLevers got;
    got.activations = stepper_->measured().activations;
    got.accum_grads = stepper_->measured().accum_grads;
    if (checkpointer_->async() && last_saved_step_ >= 0) got.async_snapshot = checkpointer_->snapshot_bytes();
    const auto report = lever_report(memory_plan(), got);
    if (report.empty()) return;
    std::printf("memory levers, plan vs measured (rank 0):");
    for (const auto& [name, v] : report.items()) {
      std::printf(" %s %.2f vs %.2f MiB (%+.1f%%);", name.c_str(), v["plan"].get<double>() / (1 << 20),
                  v["measured"].get<double>() / (1 << 20), 100 * v["error"].get<double>());
    }
    std::printf("\n");
  }

  void finish() {
    const auto report = fsdp::memory_report(*root_, optim_.get());
    RankCounters mine;
    mine.peak_rss_bytes = static_cast<double>(peak_rss_bytes());
    const auto all = gather_counters(dist_->world(), mine);
    if (tracer_) tracer_->write(trace_path(flags_.trace, rank_, world_));
    if (rank_ != 0) return;
    if (steps_trained_ > 0) {
      std::printf("done: %lld steps in %.1f s (%.3f s/step), step %lld, loss %.4f",
                  static_cast<long long>(steps_trained_), train_seconds_,
                  train_seconds_ / static_cast<double>(steps_trained_), static_cast<long long>(step_), last_loss_);
    } else {
      std::printf("done: no steps trained, step %lld", static_cast<long long>(step_));
    }
    if (last_eval_step_ >= 0) {
      std::printf(", eval loss %.4f, perplexity %.2f (step %lld)", last_eval_loss_, std::exp(last_eval_loss_),
                  static_cast<long long>(last_eval_step_));
    }
    const int64_t skipped = stepper_->scaler().state().skipped_steps;
    if (skipped > 0) std::printf(", %lld step(s) skipped (non-finite)", static_cast<long long>(skipped));
    std::printf("\nmemory measured (rank 0): %s\n", report.to_string().c_str());
    report_levers();
    if (offloads() && steps_trained_ > 1) {
      const auto io = (fsdp::offload_io(*root_) - offload_io_after_first_).per_step(steps_trained_ - 1);
      std::printf("offload measured (rank 0, per step after the first): %s\n", io.to_string().c_str());
    }
    std::printf("peak RSS per rank:");
    for (const auto& r : all) std::printf(" %.1f MiB", r.peak_rss_bytes / (1 << 20));
    std::printf("\n");
    if (!last_checkpoint_.empty()) std::printf("checkpoint: %s\n", last_checkpoint_.c_str());
    if (!flags_.metrics.empty()) std::printf("metrics: %s\n", flags_.metrics.c_str());
    if (tracer_) {
      std::printf("trace: %s%s\n", trace_path(flags_.trace, 0, world_).c_str(),
                  world_ > 1 ? " (and the other ranks' beside it)" : "");
    }
    std::fflush(stdout);
  }

  const TrainConfig& cfg_;
  const Flags& flags_;
  Dataset data_;

  std::shared_ptr<fsdp::Dist> dist_;
  c10::Device device_ = c10::Device(c10::kCPU);  // where batches go (dist_->compute_device())
  std::unique_ptr<fsdp::DeviceMesh> mesh_;
  int rank_ = 0, world_ = 1, shard_size_ = 1;
  int64_t global_batch_ = 0;  // samples per optimizer step (all ranks, all micro-batches)
  int64_t eval_batch_ = 0;    // samples per evaluation batch (all ranks)
  llama::LlamaForCausalLM model_{nullptr};
  std::shared_ptr<fsdp::FSDPModule> root_;
  std::unique_ptr<fsdp::AdamW> optim_;
  std::unique_ptr<fsdp::LRScheduler> sched_;
  std::unique_ptr<Stepper> stepper_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<CommCounter> comm_;
  std::shared_ptr<fsdp::Tracer> tracer_;  // null without --trace
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<Progress> progress_;

  int64_t step_ = 0, samples_seen_ = 0;
  int64_t last_saved_step_ = -1, last_eval_step_ = -1, steps_trained_ = 0;
  fsdp::OffloadIo offload_io_after_first_;
  bool offloads() const {
    const auto& off = cfg_.fsdp.offload;
    return off.params != "none" || off.grads != "none" || off.optimizer_state != "none";
  }
  double last_loss_ = 0, last_eval_loss_ = 0, train_seconds_ = 0;
  std::string resumed_from_, last_checkpoint_;
  std::vector<std::string> resume_notes_;  // Note [Resume changes], printed with the header
  nlohmann::json init_from_;               // TrainState.extra.init_from (init_from.h); null without one
  bool started_fresh_ = false;             // --resume latest found no checkpoint
  int stop_signal_ = 0;                    // the signal every rank agreed to stop on
};

}  // namespace

void check_supported(const TrainConfig& config) {
  // Every offload setting is supported; the directory is checked when the disk tier opens.
  (void)config;
}

int run_training(const TrainConfig& config, const Flags& flags, Dataset data) {
  Job job(config, flags, std::move(data));
  return job.run();
}

}  // namespace train
