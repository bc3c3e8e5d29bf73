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
#include "memory_plan.h"
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

Session::Session(const TrainConfig& config, const Flags& flags, Dataset data, const TrainHooks& hooks)
    : cfg(config), flags(flags), data(std::move(data)), hooks(hooks) {}

void Session::join() {
  if (cfg.fsdp.on_cuda()) use_local_gpu();
  dist = fsdp::init_from_env(cfg.fsdp.init_options());
  device = dist->compute_device();
  rank = dist->rank();
  world = dist->world_size();
  mesh = make_mesh(dist, cfg.fsdp);
  eval_batch = cfg.data.batch_size_per_rank * world;
  global_batch = eval_batch * cfg.train.grad_accum_steps;
}

// The layers' options; the root's add the output dtype and the offload policy (build()).
fsdp::FullyShardOptions Session::shard_options(bool import) const {
  fsdp::ParamInitFn init = import ? fsdp::init::constant(0.0) : llama::llama_init_fn(cfg.model, cfg.train.seed);
  auto opts =
      fsdp::FullyShardOptions().strategy(cfg.fsdp.strategy).prefetch_depth(static_cast<int>(cfg.fsdp.prefetch_depth));
  if (lora_model) {  // the adapters' init (an import never holds them); the base's storage
    init = lora_model->init(init, cfg.train.seed);
    opts.frozen_storage(lora_model->frozen_storage());
    if (cfg.lora.replicate_adapters) {
      opts.replicate_params([](const std::string& name, const at::Tensor&) { return fsdp::is_lora_adapter(name); });
    }
  }
  opts.init(init);
  const bool mixed = cfg.fsdp.param_dtype != at::kFloat;
  if (mixed) opts.mp_policy().param_dtype(cfg.fsdp.param_dtype);
  if (mixed || cfg.fsdp.reduce_dtype != at::kFloat) opts.mp_policy().reduce_dtype(cfg.fsdp.reduce_dtype);
  return opts;
}

void Session::build() {
  // Built on the meta device: no rank ever holds the whole model; each materialises its shards
  // on the first forward from llama_init_fn, which gives the same values whatever the world size.
  model = llama::LlamaForCausalLM(cfg.model, at::kMeta);
  if (cfg.lora.enabled) lora_model = apply_lora(model, cfg.lora, cfg.train.seed);
  // --init-from: the shards start at zero (cheap) and the import overwrites them, unless a
  // checkpoint is resumed (--resume latest with none saved yet starts fresh: from the import).
  start.started_fresh = flags.resume == "latest" && !any_checkpoint_saved();  // asked once: a collective
  const bool resuming = !flags.resume.empty() && !start.started_fresh;
  const std::string base = import_source(resuming);
  const bool import = !base.empty();
  const auto opts = shard_options(import);
  auto layer_opts = opts;
  layer_opts.reshard_after_forward_group(static_cast<int>(cfg.fsdp.reshard_after_forward_group));
  for (auto& layer : model->model->layers) fsdp::fully_shard(layer, *mesh, layer_opts);
  if (vocab_parallel_on(cfg)) {
    llama::shard_vocab_parallel(model, *mesh, opts);
  } else if (splits_root(cfg, run_request(cfg))) {
    llama::shard_embedding_and_head(model, *mesh, opts);
  }
  auto root_opts = opts;
  // The loss is computed in fp32 whatever the compute dtype.
  if (cfg.fsdp.param_dtype != at::kFloat) root_opts.mp_policy().output_dtype(at::kFloat);
  // Offload is set on the root; the layers inherit it (their own policy is unset).
  root_opts.offload(cfg.fsdp.offload);
  root = fsdp::fully_shard(model, *mesh, root_opts);
  if (import) {
    auto not_adapter = [](const std::string& name) { return !fsdp::is_lora_adapter(name); };
    start.init_from = import_hf_weights(base, *root, rank, cfg.model.vocab_size,
                                        lora_model ? std::function<bool(const std::string&)>(not_adapter) : nullptr);
  }
  if (lora_model && !resuming && !cfg.lora.adapter_from.empty()) {
    load_peft_adapter(cfg.lora.adapter_from, *root, cfg.lora, rank);
  }
  model->model->checkpoint_every = cfg.train.activation_checkpointing;
  model->set_loss_chunk_tokens(cfg.train.loss_chunk_tokens);

  const auto& o = cfg.optim;
  optim = std::make_unique<fsdp::AdamW>(root, o.adamw());
  optim->step_in_backward(o.step_in_backward);
  sched = make_schedule(ScheduleSpec::of(cfg));
  stepper = std::make_unique<Stepper>(cfg, data, model, root, *optim, device, rank, hooks.inf_grad_steps(rank));
  stepper->track_phase_peaks(!flags.metrics.empty());
  check_step_options(cfg, stepper->scaler(), *optim);
  checkpointer = std::make_unique<Checkpointer>(flags.save_dir, cfg.train.async_save, cfg.train.keep_last,
                                                !cfg.lora.enabled || cfg.lora.save_base);
  comm = std::make_unique<CommCounter>(*mesh);
  if (!flags.trace.empty()) {
    // The library's own spans (gathers, reductions, waits, optimizer step) land in the same trace
    // as the trainer's phases, which go on their own lane, "train".
    tracer = std::make_shared<fsdp::Tracer>(rank);
    root->set_tracer(tracer);
  }
}

// Where the weights are imported from: --init-from when starting, and when resuming a LoRA
// checkpoint that holds its adapters only (the frozen base is imported again, then the adapters
// loaded over it).
std::string Session::import_source(bool resuming) const {
  if (!resuming) return flags.init_from;
  if (!lora_model) return "";
  const std::string dir = fsdp::checkpoint::resolve(flags.save_dir, flags.resume);
  if (holds_base(fsdp::checkpoint::read_train_state(dir).extra)) return "";
  if (flags.init_from.empty()) {
    throw std::invalid_argument("--resume " + flags.resume + ": checkpoint " + dir +
                                " holds the LoRA adapters only (lora.save_base false): pass --init-from with the "
                                "base model it was trained on");
  }
  return flags.init_from;
}

void Session::resume() {
  if (flags.resume.empty()) return;
  if (start.started_fresh) return;  // --resume latest with nothing saved yet (build() asked)
  fsdp::Tracer::Scope span(tracer.get(), "train::checkpoint_load", "train", "");
  const std::string dir = fsdp::checkpoint::resolve(flags.save_dir, flags.resume);
  review_changes(dir);  // before loading: a refused resume reads and writes nothing more
  const auto p = load_checkpoint(flags.save_dir, dir, *root, *optim, cfg.config_hash());
  start.step = p.step;
  start.samples_seen = p.samples_seen;
  start.resumed_from = p.dir;
  restore_scaler(stepper->scaler(), p.extra);
  // The checkpoint's weights came from its own --init-from (recorded for fsdp-ckpt export).
  if (p.extra.contains("init_from")) {
    start.init_from = p.extra["init_from"];
  } else if (!flags.init_from.empty()) {
    start.init_from = init_from_record(flags.init_from, cfg.model.vocab_size);
  }
}

// Note [Resume changes]: the same decision on every rank, from the same train_state.json.
void Session::review_changes(const std::string& dir) {
  check_lora_resume(fsdp::checkpoint::read_train_state(dir).extra, cfg.lora, dir);
  const ResumeReview review = review_resume(fsdp::checkpoint::read_train_state(dir), dir, cfg, world);
  if (!review.lr_jump.empty() && !flags.allow_schedule_change) throw std::invalid_argument(review.lr_jump);
  start.notes = review.notes;
  if (!review.lr_jump.empty()) start.notes.push_back("the lr change is accepted (--allow-schedule-change)");
}

// --resume latest before the first save (a restarted job that never got that far, or a job
// script that always passes it) starts from step 0. Every rank must see the same answer. A
// `latest` that names no committed checkpoint (fsdp::checkpoint::has_latest false) is not a fresh
// start: resolve() then fails naming it, rather than training over a save root that lost its data.
bool Session::any_checkpoint_saved() {
  const bool mine = fsdp::io::exists(fsdp::io::join(flags.save_dir, "latest"));
  at::Tensor seen = at::full({1}, mine ? 1.0 : 0.0, at::kDouble);
  dist->world().all_reduce(seen, fsdp::ReduceOp::kSum, "train/resume_latest").wait();
  const int n = static_cast<int>(seen.item<double>());
  if (n != 0 && n != world) {
    throw std::runtime_error("--resume latest: " + std::to_string(n) + " of " + std::to_string(world) + " ranks see " +
                             flags.save_dir + "/latest; every rank needs the same --save-dir (a shared file system)");
  }
  return n == world;
}

}  // namespace train
