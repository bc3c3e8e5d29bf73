// The trainer's configuration: one JSON document with five sections (model, data, optim, fsdp,
// train), every key optional, defaults that train a small Llama on the built-in synthetic task in
// a minute or two on a laptop. A run's effective config is the defaults, then the --config file,
// then the command-line overrides (--set dotted.key=value, --steps, --seed, --data) in order.
//
// Parsing is strict: an unknown key, a wrong type or an invalid value throws std::invalid_argument
// naming the full dotted key and its value ("optim.lr=\"fast\": must be a number"), because a
// misspelt key that is silently ignored trains the wrong model for hours.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "fsdp/dist.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/plan.h"
#include "fsdp/lora.h"
#include "fsdp/optim.h"
#include "fsdp/options.h"
#include "llama.h"
#include "named.h"

namespace train {

struct DataConfig {
  DataSource source = DataSource::kSynthetic;
  std::string path;  // the file, when source is kFile
  TokenDtype token_dtype = TokenDtype::kUint16;
  // A held-out file for evaluation (same format): eval loss and perplexity come from it, and the
  // whole of `path` trains. Empty: the last 10% of `path` is held out (see data.h).
  std::string eval_path;
  int64_t seq_len = 64;  // tokens per sample (each sample holds seq_len + 1)
  // The global batch is batch_size_per_rank * world size samples; to compare runs on different
  // world sizes, keep that product fixed.
  int64_t batch_size_per_rank = 16;
};

struct OptimConfig {
  double lr = 6e-3;
  std::array<double, 2> betas{0.9, 0.95};
  double eps = 1e-8;
  double weight_decay = 0.1;
  int64_t warmup_steps = 20;
  double grad_clip = 1.0;  // max global gradient norm; 0 turns clipping off
  Schedule schedule = Schedule::kCosine;
  double min_lr = 6e-4;
  // Step each flat param during backward, as soon as its gradient is reduced
  // (ShardedOptimizer::step_in_backward): needs grad_clip 0 and no loss scaling.
  bool step_in_backward = false;
  // AdamW's moments in fp32 or bf16 (fsdp::AdamWOptions::state_dtype).
  at::ScalarType state_dtype = at::kFloat;
  // The library's options for lr, betas, eps, weight_decay and the state's dtype (fsdp::check_options
  // validates them).
  fsdp::AdamWOptions adamw() const {
    return fsdp::AdamWOptions(lr)
        .beta1(betas[0])
        .beta2(betas[1])
        .eps(eps)
        .weight_decay(weight_decay)
        .state_dtype(state_dtype);
  }
};

// fsdp.loss_scale: dynamic loss scaling (fsdp::GradScaler) on when param_dtype is float16
// ("auto"), always ("dynamic") or never ("none"). Non-finite steps are skipped in every mode.
enum class LossScale { kAuto, kDynamic, kNone };
inline constexpr Named<LossScale> kLossScales[] = {
    {LossScale::kAuto, "auto"}, {LossScale::kDynamic, "dynamic"}, {LossScale::kNone, "none"}};
inline const char* loss_scale_name(LossScale s) { return name_of(kLossScales, s); }

struct FsdpConfig {
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
  at::ScalarType param_dtype = at::kFloat;   // compute dtype of gathered parameters
  at::ScalarType reduce_dtype = at::kFloat;  // dtype gradients are reduced in
  int64_t prefetch_depth = 1;                // units whose all-gather is issued ahead (0: off)
  double timeout_s = 60;                     // rendezvous and every collective
  int64_t replicate = 1;                     // HYBRID_SHARD: number of replicas (rows of the mesh)
  // The layers' FullyShardOptions::reshard_after_forward_group (0: off).
  int64_t reshard_after_forward_group = 0;
  // The embedding and the head as units of their own (llama::shard_embedding_and_head): on, off,
  // or auto: when the head is not tied and the plan's peak is lower that way.
  Switch split_root = Switch::kAuto;
  // The embedding and the head as vocab-parallel tables (llama::shard_vocab_parallel): on, off, or
  // auto: whenever they are frozen (a LoRA run whose targets leave out lm_head).
  Switch vocab_parallel = Switch::kAuto;
  // fsdp.offload, set on the root unit (the layers inherit it); validated by the library.
  fsdp::OffloadPolicy offload;
  bool check_collectives = false;  // fsdp.debug.check_collectives: see fsdp::InitOptions
  // "cpu" (Gloo) or "cuda" (NCCL; rank r uses CUDA device LOCAL_RANK): see fsdp::InitOptions.
  std::string device = "cpu";
  bool on_cuda() const { return c10::Device(device).is_cuda(); }
  // The library's options for timeout_s, device and check_collectives (fsdp::check_options).
  fsdp::InitOptions init_options() const {
    return fsdp::InitOptions()
        .timeout(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)))
        .device(device)
        .check_collectives(check_collectives);
  }
  LossScale loss_scale = LossScale::kAuto;
  // fsdp.loss_scale_init, fsdp.loss_scale_growth_interval and train.max_consecutive_skips; enabled
  // follows loss_scale and param_dtype (set by from_json, see scaler_options()).
  fsdp::GradScalerOptions scaler = fsdp::GradScalerOptions().enabled(false).max_consecutive_skips(10);
  bool loss_scaling() const {
    return loss_scale == LossScale::kDynamic || (loss_scale == LossScale::kAuto && param_dtype == at::kHalf);
  }
};

struct RunConfig {
  uint64_t seed = 0;         // parameter init and data order
  int64_t steps = 200;       // the total number of optimizer steps to reach
  int64_t eval_every = 50;   // 0: no evaluation
  int64_t eval_batches = 4;  // global batches per evaluation
  int64_t save_every = 0;    // 0: save only at the end (needs --save-dir)
  int64_t keep_last = 0;     // committed checkpoints to keep; 0 keeps all
  int64_t log_every = 10;    // plain log lines (when stdout is not a terminal)
  // Micro-batches of data.batch_size_per_rank per optimizer step; the loss equals the run with a
  // batch that many times larger.
  int64_t grad_accum_steps = 1;
  // How they accumulate (fsdp::Accumulation): no_sync (gradients reduced once, on the last), or
  // reduce_scatter (each reduce-scattered; under HYBRID_SHARD the replicas' all-reduce on the
  // last only), or reduce (each reduced in full).
  fsdp::Accumulation accumulation = fsdp::Accumulation::kNoSync;
  // Every unit keeps its gathered parameters across the micro-batches of a step: one all-gather
  // per unit per step (FSDPModule::set_reshard_after_forward/_backward), all units gathered at once.
  bool keep_gathered = false;
  // Activation checkpointing: 0 ("none"), 1 ("every": every layer) or n (layers 0, n, 2n, ...).
  int64_t activation_checkpointing = 0;
  // The head and the loss over this many tokens at a time (fsdp::chunked_cross_entropy): the
  // [tokens, vocab] logits never exist whole. 0: whole logits.
  int64_t loss_chunk_tokens = 0;
  bool async_save = false;  // write checkpoints in the background (one in flight)
  // A synchronous save written during the optimizer step before it (fsdp::checkpoint::SaveInStep):
  // on, off, or auto: when a master or optimizer state is in the disk tier, which a save would
  // otherwise read back.
  Switch save_in_step = Switch::kAuto;
  // train.budget: per-rank budgets the run's plan (fsdp/plan.h) must fit before anything is
  // allocated; 0: this machine's (host: MemAvailable / ranks on the node; disk: free space under
  // fsdp.offload.dir; device: not checked). check false: the plan is printed, not enforced.
  int64_t budget_host_bytes = 0, budget_device_bytes = 0, budget_disk_bytes = 0;
  bool check_budget = true;
  // The percentage of the device's budget (on CPU runs the host's) held free for what the plan does
  // not count (PlanRequest::margin): fsdp-plan's default margin (fsdp::kDefaultMargin) unless set.
  double budget_margin_pct = 100 * fsdp::kDefaultMargin;
  // train.max_consecutive_skips (a step whose loss or gradient norm is not finite is skipped on
  // every rank; this many in a row stop the run with an error instead, 0: never) is kept in
  // FsdpConfig::scaler, the library's option.
};

// The lora section: fine-tune adapters on a frozen base (fsdp::lora). A config with the section is
// a LoRA run unless lora.enabled is false.
struct LoraConfig {
  bool enabled = false;
  std::vector<std::string> targets{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  int64_t r = 8;
  double alpha = 16;
  double dropout = 0;
  // How the frozen base is kept: bfloat16, float16, float32 (every frozen parameter), int8 or nf4
  // (the targets' weights; the other frozen parameters in fsdp.param_dtype).
  fsdp::FrozenStorage base_dtype = fsdp::FrozenStorage::kBFloat16;
  bool save_base = false;  // checkpoints hold the base too (else adapters and their state only)
  // A bitsandbytes 4-bit --init-from base in the disk tier reads its NF4 codes from those files
  // (fsdp::checkpoint::ImportOptions::codes_in_place) instead of a copy in the tier.
  bool base_in_place = true;
  // The adapters whole on every rank, all-reduced (FullyShardOptions::replicate_params), not sharded.
  bool replicate_adapters = false;
  std::string adapter_from;  // a PEFT adapter directory the adapters start from
  fsdp::LoraOptions options() const {
    return fsdp::LoraOptions().targets(targets).r(r).alpha(alpha).dropout(dropout).base_dtype(base_dtype);
  }
};

struct TrainConfig {
  TrainConfig();  // the built-in defaults, including the small model below

  llama::LlamaConfig model;
  DataConfig data;
  OptimConfig optim;
  FsdpConfig fsdp;
  RunConfig train;
  LoraConfig lora;

  // Every key with its effective value; from_json(to_json()) gives the same config back.
  nlohmann::json to_json() const;
  // Starts from the defaults; see the top of this file for what is rejected.
  static TrainConfig from_json(const nlohmann::json& j);
  // FNV-1a (64-bit, hex) over the canonical dump of what identifies the model and its data stream:
  // the model section and data.{source, path, seq_len, token_dtype}. batch_size_per_rank is left out on
  // purpose: resuming on another world size changes it while the sample stream stays the same.
  std::string config_hash() const;
};

// The model section's built-in default: ~0.9M parameters. With the other defaults, 200 steps on 2
// ranks take about a minute on two CPU cores and bring the synthetic task's loss from log(256) =
// 5.55 to about 1.0 (the chain by step ~60, the copied half after that).
llama::LlamaConfig default_model_config();

// "bfloat16" / "float16" / "float32" (also "bf16", "fp16", "fp32") and back.
at::ScalarType parse_dtype(const std::string& key, const std::string& name);
const char* dtype_name(at::ScalarType t);

// Sets `dotted_key` (e.g. "optim.lr") in `doc` to `value`, creating intermediate objects; the
// value is parsed as JSON when it parses ("3e-4", "[0.9, 0.95]", "true") and taken as a string
// otherwise ("FULL_SHARD"). Throws std::invalid_argument when a path component is not an object.
void set_dotted(nlohmann::json& doc, const std::string& dotted_key, const std::string& value);

// Reads a JSON config file; throws std::invalid_argument naming the file when it cannot be read
// or does not hold a JSON object.
nlohmann::json read_config_file(const std::string& path);

// The effective config: defaults, then `file_doc` (may be null), then `overrides` in order.
TrainConfig build_config(const nlohmann::json& file_doc,
                         const std::vector<std::pair<std::string, std::string>>& overrides);

}  // namespace train
