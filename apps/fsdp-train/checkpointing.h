// The trainer's use of fsdp/checkpoint.h, in one place: checkpoint names, what goes into
// TrainState.extra, and the checks made on resume.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "fsdp/optim.h"

namespace train {

// "step-00000100": zero-padded so that names sort by step.
std::string checkpoint_name(int64_t step);

// Saves synchronously, or with `async` through fsdp::checkpoint::AsyncSaver: the shards are copied
// to host memory and written by a background thread while training goes on. At most one save is
// in flight (a second waits for the first); wait() (and the destructor) wait for it.
class Checkpointer {
 public:
  // keep_last = 0 keeps every checkpoint; frozen_params: SaveOptions::frozen_params (a LoRA run
  // without lora.save_base saves its adapters and their state only); on_phase, when set, is called
  // as each phase of every save begins (SaveOptions::on_phase; TrainHooks::save_phases).
  Checkpointer(std::string save_dir, bool async, int64_t keep_last, bool frozen_params,
               std::function<void(const std::string& phase)> on_phase = nullptr);
  // Collective. Returns the checkpoint's directory (committed when synchronous; being written when
  // asynchronous, committed by the next save, wait() or the end of the run). `extra` goes to
  // TrainState.extra.
  std::string save(int64_t step, int64_t samples_seen, fsdp::FSDPModule& root, fsdp::ShardedOptimizer& optim,
                   const nlohmann::json& extra);
  // Begins the synchronous save of step `step` before that step, so that its optimizer step writes
  // its trainable shards as it holds them (fsdp::checkpoint::SaveInStep); save(step, ...) finishes
  // it. Collective. Not with async saves (std::logic_error).
  void begin_in_step(int64_t step, fsdp::FSDPModule& root, fsdp::ShardedOptimizer& optim);
  // This rank's bytes of the last save written during its step (0: none, or not begun so).
  int64_t bytes_written_in_step() const { return last_in_step_bytes_; }
  // Waits for the save in flight; rethrows its error (every rank gets the same one).
  void wait();
  bool async() const { return saver_ != nullptr; }
  int64_t snapshot_bytes() const { return saver_ ? saver_->snapshot_bytes() : 0; }

 private:
  std::string save_dir_;
  fsdp::checkpoint::SaveOptions options_;
  std::unique_ptr<fsdp::checkpoint::AsyncSaver> saver_;    // null: synchronous
  std::unique_ptr<fsdp::checkpoint::SaveInStep> in_step_;  // begun for step in_step_step_
  int64_t in_step_step_ = -1;
  int64_t last_in_step_bytes_ = 0;
};

struct ResumePoint {
  std::string dir;  // the checkpoint loaded
  int64_t step = 0;
  int64_t samples_seen = 0;
  nlohmann::json extra;
};

// Loads `which` ("latest": the newest committed one in save_dir; else a checkpoint directory)
// into root and optim (collective). Throws std::invalid_argument when the checkpoint's
// config_hash differs from `config_hash`: its model or data stream is not this run's.
ResumePoint load_checkpoint(const std::string& save_dir, const std::string& which, fsdp::FSDPModule& root,
                            fsdp::ShardedOptimizer& optim, const std::string& config_hash);

}  // namespace train
