// The job's session: what a run has before its first step. join() makes the process group and
// the mesh, build() the sharded model, its optimizer, schedule and stepper, resume() loads the
// checkpoint --resume names (after reviewing what the run changes against it). The loop
// (loop.h) and the reports (report.h) work on it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include "checkpointing.h"
#include "config.h"
#include "data.h"
#include "flags.h"
#include "fsdp/device_mesh.h"
#include "fsdp/dist.h"
#include "fsdp/fully_shard.h"
#include "fsdp/optim.h"
#include "fsdp/trace.h"
#include "hooks.h"
#include "llama.h"
#include "metrics.h"
#include "run_plan.h"
#include "step.h"

namespace train {

// Where the run starts: step 0, or the checkpoint it resumed from.
struct StartPoint {
  int64_t step = 0;
  int64_t samples_seen = 0;
  std::string resumed_from;        // the checkpoint loaded; empty when starting at step 0
  std::vector<std::string> notes;  // Note [Resume changes], printed with the header
  bool started_fresh = false;      // --resume latest found no checkpoint
  nlohmann::json init_from;        // TrainState.extra.init_from (init_from.h); null without one
};

// What join() makes: the process group, the mesh, this rank's place, the batches' sizes.
struct Ranks {
  std::shared_ptr<fsdp::Dist> dist;
  c10::Device device = c10::Device(c10::kCPU);  // where batches go (dist->compute_device())
  std::unique_ptr<fsdp::DeviceMesh> mesh;
  int rank = 0, world = 1;
  int64_t global_batch = 0;  // samples per optimizer step (all ranks, all micro-batches)
  int64_t eval_batch = 0;    // samples per evaluation batch (all ranks)
};

// What build() makes: the sharded model and what steps, saves, counts and traces it.
struct Training {
  llama::LlamaForCausalLM model{nullptr};
  std::optional<fsdp::LoraModel> lora_model;  // the lora section's adapters (lora_setup.h)
  std::shared_ptr<fsdp::FSDPModule> root;
  std::unique_ptr<fsdp::AdamW> optim;
  std::unique_ptr<fsdp::LRScheduler> sched;
  std::unique_ptr<Stepper> stepper;
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<CommCounter> comm;
  std::shared_ptr<fsdp::Tracer> tracer;  // null without --trace
};

class Session {
 public:
  // `plan`: the choices and the plan made before the job joined (run_plan.h), which the session,
  // the loop and the reports read and never make again.
  Session(const TrainConfig& config, const Flags& flags, const RunPlan& plan, Dataset data, const TrainHooks& hooks);

  // The process group and the mesh: everything a run has before its model. Collective.
  void join();
  // The model on the meta device, sharded; the optimizer, schedule, stepper, checkpointer and
  // tracer. Collective (--resume latest asks every rank whether a checkpoint exists).
  void build();
  // With --resume: reviews the changes against the checkpoint, then loads it. Collective.
  void resume();

  // What the run was given.
  const TrainConfig& cfg() const { return cfg_; }
  const Flags& flags() const { return flags_; }
  const RunPlan& plan() const { return plan_; }
  const Dataset& data() const { return data_; }
  const TrainHooks& hooks() const { return hooks_; }
  // What join(), build() and resume() made.
  const Ranks& ranks() const { return ranks_; }
  Training& training() { return training_; }
  const Training& training() const { return training_; }
  const StartPoint& start() const { return start_; }

 private:
  fsdp::FullyShardOptions shard_options(bool import) const;
  std::string import_source(bool resuming) const;
  void review_changes(const std::string& dir);
  bool any_checkpoint_saved();

  const TrainConfig& cfg_;
  const Flags& flags_;
  const RunPlan& plan_;
  Dataset data_;
  const TrainHooks& hooks_;
  Ranks ranks_;
  Training training_;
  StartPoint start_;
};

}  // namespace train
