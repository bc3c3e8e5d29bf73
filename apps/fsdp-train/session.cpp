// The session of the fsdp-train job: join, build, resume (session.h).
#include "session.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/full.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/init.h"
#include "init_from.h"
#include "lora_setup.h"
#include "resume_review.h"
#include "schedule.h"

namespace train {
namespace {

// fsdp.device=cuda: this rank computes on CUDA device LOCAL_RANK, made current before the process
// group exists (NCCL binds to it).
void use_local_gpu() {
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

// The 1-D mesh, or HYBRID_SHARD's fsdp.replicate rows: the library checks that they divide the
// world (on every rank, before any group exists), and its error is given the config key.
std::unique_ptr<fsdp::DeviceMesh> make_mesh(const std::shared_ptr<fsdp::Dist>& dist, const FsdpConfig& cfg) {
  if (cfg.strategy != fsdp::ShardingStrategy::kHybridShard) return std::make_unique<fsdp::DeviceMesh>(dist);
  // Above any world size (and int) it stays above: the library refuses it like any non-divisor.
  const int replicate = static_cast<int>(std::min<int64_t>(cfg.replicate, std::numeric_limits<int>::max()));
  try {
    return std::make_unique<fsdp::DeviceMesh>(dist, replicate, dist->world_size() / replicate);
  } catch (const fsdp::ConfigError& e) {
    // "fsdp: DeviceMesh: replicate_size=R: why" -> "config: fsdp.replicate=R: why".
    std::string why = e.what();
    const std::string prefix = "fsdp: DeviceMesh: replicate_size=" + std::to_string(replicate) + ": ";
    if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
    throw std::invalid_argument("config: fsdp.replicate=" + std::to_string(cfg.replicate) + ": " + why +
                                " (HYBRID_SHARD replicates over that many rows of ranks)");
  }
}

// optim.step_in_backward against clipping and loss scaling: the library's check, asked once the
// optimizer and the scaler exist, before the first step, and given the config keys.
void check_step_options(const TrainConfig& cfg, const fsdp::GradScaler& scaler, const fsdp::ShardedOptimizer& optim) {
  try {
    scaler.check_step_options(optim, cfg.optim.grad_clip);
  } catch (const fsdp::ConfigError& e) {
    throw std::invalid_argument(
        "config: optim.step_in_backward=true needs optim.grad_clip 0 and no loss scaling (got optim.grad_clip=" +
        nlohmann::json(cfg.optim.grad_clip).dump() + ", fsdp.loss_scale=\"" + loss_scale_name(cfg.fsdp.loss_scale) +
        "\", fsdp.param_dtype=" + dtype_name(cfg.fsdp.param_dtype) + "): " + e.what());
  }
}

}  // namespace

Session::Session(const TrainConfig& config, const Flags& flags, const RunPlan& plan, Dataset data,
                 const TrainHooks& hooks)
    : cfg_(config), flags_(flags), plan_(plan), data_(std::move(data)), hooks_(hooks) {}

void Session::join() {
  if (cfg_.fsdp.on_cuda()) use_local_gpu();
  Ranks& r = ranks_;
  r.dist = fsdp::init_from_env(cfg_.fsdp.init_options());
  r.device = r.dist->compute_device();
  r.rank = r.dist->rank();
  r.world = r.dist->world_size();
  r.mesh = make_mesh(r.dist, cfg_.fsdp);
  r.eval_batch = cfg_.data.batch_size_per_rank * r.world;
  r.global_batch = r.eval_batch * cfg_.train.grad_accum_steps;
}

// The layers' options; the root's add the output dtype and the offload policy (build()).
fsdp::FullyShardOptions Session::shard_options(bool import) const {
  fsdp::ParamInitFn init = import ? fsdp::init::constant(0.0) : llama::llama_init_fn(cfg_.model, cfg_.train.seed);
  auto opts =
      fsdp::FullyShardOptions().strategy(cfg_.fsdp.strategy).prefetch_depth(static_cast<int>(cfg_.fsdp.prefetch_depth));
  if (const auto& lora = training_.lora_model) {  // the adapters' init (an import never holds them); the base's
    init = lora->init(init, cfg_.train.seed);
    opts.frozen_storage(lora->frozen_storage());
    if (cfg_.lora.replicate_adapters) {
      opts.replicate_params([](const std::string& name, const at::Tensor&) { return fsdp::is_lora_adapter(name); });
    }
  }
  opts.init(init);
  const bool mixed = cfg_.fsdp.param_dtype != at::kFloat;
  if (mixed) opts.mp_policy().param_dtype(cfg_.fsdp.param_dtype);
  if (mixed || cfg_.fsdp.reduce_dtype != at::kFloat) opts.mp_policy().reduce_dtype(cfg_.fsdp.reduce_dtype);
  return opts;
}

void Session::build() {
  const Ranks& r = ranks_;
  Training& t = training_;
  // Built on the meta device: no rank ever holds the whole model; each materialises its shards
  // on the first forward from llama_init_fn, which gives the same values whatever the world size.
  t.model = llama::LlamaForCausalLM(cfg_.model, at::kMeta);
  if (cfg_.lora.enabled) t.lora_model = apply_lora(t.model, cfg_.lora, cfg_.train.seed);
  // --init-from: the shards start at zero (cheap) and the import overwrites them, unless a
  // checkpoint is resumed (--resume latest with none saved yet starts fresh: from the import).
  start_.started_fresh = flags_.resume == "latest" && !any_checkpoint_saved();  // asked once: a collective
  const bool resuming = !flags_.resume.empty() && !start_.started_fresh;
  const std::string base = import_source(resuming);
  const auto opts = shard_options(!base.empty());
  auto layer_opts = opts;
  layer_opts.reshard_after_forward_group(static_cast<int>(cfg_.fsdp.reshard_after_forward_group));
  for (auto& layer : t.model->model->layers) fsdp::fully_shard(layer, *r.mesh, layer_opts);
  if (plan_.resolved.vocab_parallel) {
    llama::shard_vocab_parallel(t.model, *r.mesh, opts);
  } else if (plan_.resolved.split_root) {
    llama::shard_embedding_and_head(t.model, *r.mesh, opts);
  }
  auto root_opts = opts;
  // The loss is computed in fp32 whatever the compute dtype.
  if (cfg_.fsdp.param_dtype != at::kFloat) root_opts.mp_policy().output_dtype(at::kFloat);
  // Offload is set on the root; the layers inherit it (their own policy is unset).
  root_opts.offload(cfg_.fsdp.offload);
  t.root = fsdp::fully_shard(t.model, *r.mesh, root_opts);
  if (!base.empty()) {
    auto not_adapter = [](const std::string& name) { return !fsdp::is_lora_adapter(name); };
    start_.init_from = import_hf_weights(base, *t.root, r.rank, cfg_.model.vocab_size,
                                         t.lora_model ? std::function<bool(const std::string&)>(not_adapter) : nullptr,
                                         cfg_.lora.base_in_place);
  }
  if (t.lora_model && !resuming && !cfg_.lora.adapter_from.empty()) {
    load_peft_adapter(cfg_.lora.adapter_from, *t.root, cfg_.lora, r.rank);
  }
  t.model->model->checkpoint_every = cfg_.train.activation_checkpointing;
  t.model->set_loss_chunk_tokens(cfg_.train.loss_chunk_tokens);

  t.optim = std::make_unique<fsdp::AdamW>(t.root, cfg_.optim.adamw());
  t.optim->step_in_backward(cfg_.optim.step_in_backward);
  t.sched = make_schedule(ScheduleSpec::of(cfg_));
  t.stepper = std::make_unique<Stepper>(cfg_, data_, t.model, t.root, *t.optim, r.device, r.rank,
                                        hooks_.inf_grad_steps(r.rank));
  t.stepper->track_phase_peaks(!flags_.metrics.empty());
  check_step_options(cfg_, t.stepper->scaler(), *t.optim);
  t.checkpointer =
      std::make_unique<Checkpointer>(flags_.save_dir, cfg_.train.async_save, cfg_.train.keep_last,
                                     !cfg_.lora.enabled || cfg_.lora.save_base, hooks_.save_phases(r.rank));
  t.comm = std::make_unique<CommCounter>(*r.mesh);
  if (!flags_.trace.empty()) {
    // The library's own spans (gathers, reductions, waits, optimizer step) land in the same trace
    // as the trainer's phases, which go on their own lane, "train".
    t.tracer = std::make_shared<fsdp::Tracer>(r.rank);
    t.root->set_tracer(t.tracer);
  }
}

// Where the weights are imported from: --init-from when starting, and when resuming a LoRA
// checkpoint that holds its adapters only (the frozen base is imported again, then the adapters
// loaded over it).
std::string Session::import_source(bool resuming) const {
  if (!resuming) return flags_.init_from;
  if (!training_.lora_model) return "";
  const std::string dir = fsdp::checkpoint::resolve(flags_.save_dir, flags_.resume);
  if (holds_base(fsdp::checkpoint::read_train_state(dir).extra)) return "";
  if (flags_.init_from.empty()) {
    throw std::invalid_argument("--resume " + flags_.resume + ": checkpoint " + dir +
                                " holds the LoRA adapters only (lora.save_base false): pass --init-from with the "
                                "base model it was trained on");
  }
  return flags_.init_from;
}

void Session::resume() {
  if (flags_.resume.empty()) return;
  if (start_.started_fresh) return;  // --resume latest with nothing saved yet (build() asked)
  fsdp::Tracer::Scope span(training_.tracer.get(), "train::checkpoint_load", "train", "");
  const std::string dir = fsdp::checkpoint::resolve(flags_.save_dir, flags_.resume);
  review_changes(dir);  // before loading: a refused resume reads and writes nothing more
  const auto p = load_checkpoint(flags_.save_dir, dir, *training_.root, *training_.optim, cfg_.config_hash());
  start_.step = p.step;
  start_.samples_seen = p.samples_seen;
  start_.resumed_from = p.dir;
  restore_scaler(training_.stepper->scaler(), p.extra);
  // The checkpoint's weights came from its own --init-from (recorded for fsdp-ckpt export).
  if (p.extra.contains("init_from")) {
    start_.init_from = p.extra["init_from"];
  } else if (!flags_.init_from.empty()) {
    start_.init_from = init_from_record(flags_.init_from, cfg_.model.vocab_size);
  }
}

// Note [Resume changes]: the same decision on every rank, from the same train_state.json.
void Session::review_changes(const std::string& dir) {
  check_lora_resume(fsdp::checkpoint::read_train_state(dir).extra, cfg_.lora, dir);
  const ResumeReview review = review_resume(fsdp::checkpoint::read_train_state(dir), dir, cfg_, ranks_.world);
  if (!review.lr_jump.empty() && !flags_.allow_schedule_change) throw std::invalid_argument(review.lr_jump);
  start_.notes = review.notes;
  if (!review.lr_jump.empty()) start_.notes.push_back("the lr change is accepted (--allow-schedule-change)");
}

// --resume latest before the first save (a restarted job that never got that far, or a job
// script that always passes it) starts from step 0. Every rank must see the same answer. A
// `latest` that names no committed checkpoint (fsdp::checkpoint::has_latest false) is not a fresh
// start: resolve() then fails naming it, rather than training over a save root that lost its data.
bool Session::any_checkpoint_saved() {
  const bool mine = fsdp::io::exists(fsdp::io::join(flags_.save_dir, "latest"));
  at::Tensor seen = at::full({1}, mine ? 1.0 : 0.0, at::kDouble);
  ranks_.dist->world().all_reduce(seen, fsdp::ReduceOp::kSum, "train/resume_latest").wait();
  const int n = static_cast<int>(seen.item<double>()), world = ranks_.world;
  if (n != 0 && n != world) {
    throw std::runtime_error("--resume latest: " + std::to_string(n) + " of " + std::to_string(world) + " ranks see " +
                             flags_.save_dir + "/latest; every rank needs the same --save-dir (a shared file system)");
  }
  return n == world;
}

}  // namespace train
