// Checkpoint save and resume for fsdp-train, through fsdp::checkpoint.
#include "checkpointing.h"

#include <cstdio>
#include <stdexcept>
#include <utility>

#include "fsdp/checkpoint.h"

namespace train {

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

Checkpointer::Checkpointer(std::string save_dir, bool async, int64_t keep_last, bool frozen_params,
                           std::function<void(const std::string& phase)> on_phase)
    : save_dir_(std::move(save_dir)),
      options_(fsdp::checkpoint::SaveOptions()
                   .keep_last(static_cast<int>(keep_last))
                   .frozen_params(frozen_params)
                   .on_phase(std::move(on_phase))) {
  if (async) saver_ = std::make_unique<fsdp::checkpoint::AsyncSaver>();
}

std::string Checkpointer::save(int64_t step, int64_t samples_seen, fsdp::FSDPModule& root,
                               fsdp::ShardedOptimizer& optim, const nlohmann::json& extra) {
  fsdp::checkpoint::TrainState state;
  state.step = step;
  state.samples_seen = samples_seen;
  state.extra = extra;
  last_in_step_bytes_ = 0;
  // One begun for this very step finishes; any other is dropped unfinished (nothing committed)
  // and the save is made whole.
  std::unique_ptr<fsdp::checkpoint::SaveInStep> begun = std::move(in_step_);
  if (begun && in_step_step_ == step) {
    last_in_step_bytes_ = begun->bytes_written_in_step();
    return begun->finish(state);
  }
  begun.reset();
  if (!saver_) return fsdp::checkpoint::save(save_dir_, checkpoint_name(step), root, &optim, state, options_);
  saver_->save(save_dir_, checkpoint_name(step), root, &optim, state, options_);
  return save_dir_ + "/" + checkpoint_name(step);
}

void Checkpointer::begin_in_step(int64_t step, fsdp::FSDPModule& root, fsdp::ShardedOptimizer& optim) {
  if (saver_) throw std::logic_error("Checkpointer::begin_in_step with async saves");
  in_step_.reset();  // one at a time: the optimizer has one observer
  in_step_ = std::make_unique<fsdp::checkpoint::SaveInStep>(save_dir_, checkpoint_name(step), root, optim, options_);
  in_step_step_ = step;
}

void Checkpointer::wait() {
  if (saver_) saver_->wait();
}

ResumePoint load_checkpoint(const std::string& save_dir, const std::string& which, fsdp::FSDPModule& root,
                            fsdp::ShardedOptimizer& optim, const std::string& config_hash) {
  ResumePoint p;
  p.dir = fsdp::checkpoint::resolve(save_dir, which);
  const auto state = fsdp::checkpoint::load(p.dir, root, &optim);
  p.step = state.step;
  p.samples_seen = state.samples_seen;
  p.extra = state.extra;
  // The tensors loaded by name and shape, which does not catch a changed data stream (or a model
  // change that keeps every shape, e.g. rope_theta): the hash does.
  if (p.extra.contains("config_hash") && p.extra["config_hash"].is_string() &&
      p.extra["config_hash"].get<std::string>() != config_hash) {
    throw std::invalid_argument("checkpoint " + p.dir + " was saved with config_hash " +
                                p.extra["config_hash"].get<std::string>() +
                                " (model and data sections), this run has " + config_hash +
                                "; resume with the checkpoint's model and data config (saved in its "
                                "train_state.json under extra.config)");
  }
  return p;
}

}  // namespace train
