// One checkpoint save as a plain record: what to write (layout + shard data), where, and the
// communicator and store its ranks agree through. The synchronous save runs it at once; the
// asynchronous saver snapshots it and runs it on a background thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "checkpoint/layout.h"
#include "safetensors/safetensors.h"
#include "fsdp/checkpoint.h"
#include "fsdp/comm.h"

namespace fsdp::checkpoint {

struct SaveJob {
  std::string root_dir;
  std::string name;
  CheckpointLayout layout;  // names, shapes and offsets: run_save reads the shards from `data` only
  ShardData data;
  TrainState state;
  SaveOptions options;
  Communicator* group = nullptr;  // the save's own communicator (Dist::side_group)
  c10::intrusive_ptr<c10d::Store> store;
  std::string store_prefix;  // unique per save, the same on every rank (Note [Save keys], save.cpp)
  std::string strategy;
  std::string optim_type;
  std::vector<std::string> state_names;
  std::string rng;             // this rank's CPU generator state, base64
  std::shared_ptr<void> lock;  // rank 0, from prepare to the end: NAME.tmp's lock (Note [Orphaned saves])
};

// copy = true snapshots the shards into host memory (background saves).
SaveJob make_save_job(const std::string& root_dir, const std::string& name, FSDPModule& root,
                      ShardedOptimizer* optimizer, const TrainState& state, const SaveOptions& options, bool copy);
// Collective over job.group: prepare, write, commit, agreeing between phases.
void run_save(SaveJob& job);

// run_save's phases, for a save split around an optimizer step (SaveInStep, save_in_step.cpp).
// Each is collective and agrees at its end. The write phase runs `first` (may be null; it may
// throw, which fails the phase) and then writes this rank's shards, skipping the flat slots
// `written` marks (empty: none).
std::string tmp_dir(const SaveJob& job);  // root_dir/name.tmp, where the files are laid out
void prepare_phase(SaveJob& job);
// Runs `work` on every rank, then agrees (Note [Save agreement]): `phase` names it in the error.
void agree_on(SaveJob& job, const std::string& phase, const std::function<void()>& work);
void write_phase(SaveJob& job, const std::vector<char>& written, const std::function<void()>& first);
void commit_phase(SaveJob& job);

// The files of a save: "model", then "optim.<state name>" each.
std::vector<std::string> file_kinds(const SaveJob& job);
// A file kind's tensors, in layout order (optimizer files: trainable tensors only).
std::vector<safetensors::TensorSpec> specs_for(const SaveJob& job, const std::string& kind);
safetensors::FilePlan file_plan(const SaveJob& job, const std::string& kind);  // its header and offsets
// One contiguous piece of a file this rank writes: `count` elements from element `shard_begin` of
// flat slot `flat`'s shard, at byte `at` of the file. The consecutive tensors of a flat param make
// one run, so each shard streams through once, to one run of the file.
struct Run {
  size_t flat = 0;
  int64_t shard_begin = 0, count = 0, at = 0;
};
std::vector<Run> runs_for(const SaveJob& job, const std::string& kind, const safetensors::FilePlan& plan);

// Tests only: called by every rank at the start of each save phase ("prepare", "write",
// "commit"; rank 0 also "rename" and "latest" inside the commit), so a test can fail or kill a rank
// exactly there. Empty by default.
void set_fault_hook_for_testing(std::function<void(const std::string& phase, int rank)> hook);

std::string rng_state_base64();
void restore_rng_state_base64(const std::string& text);

}  // namespace fsdp::checkpoint
