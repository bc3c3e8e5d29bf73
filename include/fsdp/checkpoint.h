// Sharded checkpoints: standard safetensors files with full, named tensors plus a JSON index,
// written in place by every rank (each rank writes only the bytes of its shards, at offsets
// computed from the model alone), committed atomically, and loadable on any world size and
// strategy by reading only the needed byte ranges.
//
//   dir/step-00000100/model.safetensors            fp32 master params, named by named_parameters()
//   dir/step-00000100/optim.exp_avg.safetensors     one file per optimizer state, same names
//   dir/step-00000100/model.safetensors.index.json  {"metadata": {...}, "weight_map": {...}}
//   dir/step-00000100/train_state.json              written last: its presence marks the commit
//   dir/latest                                      the name of the newest committed checkpoint
#pragma once

#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include "fsdp/fully_shard.h"

namespace fsdp {
class ShardedOptimizer;
}

namespace fsdp::checkpoint {

constexpr int kFormatVersion = 1;

// What a trainer needs to resume exactly, besides the tensors.
struct TrainState {
  int64_t step = 0;          // optimizer steps taken
  int64_t samples_seen = 0;  // data position as a global sample index (independent of world size)
  nlohmann::json extra = nlohmann::json::object();  // anything the trainer registers
  // Filled in by save(), read back by load():
  int world_size = 0;
  std::string strategy;
  std::vector<std::string> rng_states;  // per rank, this process's CPU generator state (base64)
};

struct SaveOptions {
  // Keep the newest K committed checkpoints of root_dir (0: keep all). Newest by the step each
  // records (TrainState::step), then, among equal steps, by the order they were committed in
  // (train_state.json's commit_index), never by name; the one just saved and the one `latest`
  // names are never removed.
  TORCH_ARG(int, keep_last) = 0;
  TORCH_ARG(bool, update_latest) = true;  // point dir/latest at this checkpoint after the commit
  // Called on every rank as each phase begins: "prepare" (the files are laid out), "write" (this
  // rank's shards), "commit" (rank 0 makes it visible). For progress reports; it must not throw.
  TORCH_ARG(std::function<void(const std::string& phase)>, on_phase) = nullptr;
  // Whether the frozen parameters (requires_grad false: a LoRA model's base) are saved. Off, the
  // checkpoint holds the trainable parameters and their optimizer state only, and load() restores
  // those, leaving the frozen ones as they are (import the base again before loading).
  TORCH_ARG(bool, frozen_params) = true;
};

// Saves into root_dir/name atomically (written as name.tmp, renamed on success). Collective: every
// rank calls it. A failure on any rank raises the same error on every rank naming the failing
// rank, nothing is committed and name.tmp is removed. A save also removes the *.tmp directories
// that earlier saves into root_dir left when their process died (never a save in progress, here or
// in another process: see Note [Orphaned saves] in src/checkpoint/save.cpp). Returns the committed
// directory.
std::string save(const std::string& root_dir, const std::string& name, FSDPModule& root, ShardedOptimizer* optimizer,
                 const TrainState& state, const SaveOptions& options = {});

// Background saving: snapshot() copies this rank's shards to host memory and returns; the files
// are written by a background thread. One save in flight: a second save waits for the first.
class AsyncSaver {
 public:
  AsyncSaver();
  ~AsyncSaver();  // waits for the save in flight
  void save(const std::string& root_dir, const std::string& name, FSDPModule& root, ShardedOptimizer* optimizer,
            const TrainState& state, const SaveOptions& options = {});
  // Waits for the save in flight; rethrows its error.
  void wait();
  // Whether a save is still being written.
  bool in_flight() const;
  // The bytes of host memory the last save's snapshot took (held until its write ends).
  int64_t snapshot_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Note [A save fused into the step]
// A save right after an optimizer step whose state lives in the disk tier would read every byte
// of that state back from the disk the step has just written it to. SaveInStep avoids the read:
// made before the step (collective: it lays out root_dir/name.tmp as save() does), it observes
// the step (ShardedOptimizer::observe_next_step) and writes each chunk of new master values and
// state into the checkpoint's files while the step holds it in memory; finish(), after the step,
// writes what the step did not (frozen parameters, buffers, flat params it skipped or that
// stepped before it was made, or a step that did not run), then commits as save() does. The
// files are the same bytes save() would write after the step. A second step before finish(), or
// a write that failed during the step (reported by finish(), on every rank, nothing committed),
// sends finish() back to writing those flat params itself. Destroyed unfinished, it commits
// nothing (the next save of the name clears its .tmp). `optimizer` must outlive it.
class SaveInStep {
 public:
  SaveInStep(const std::string& root_dir, const std::string& name, FSDPModule& root, ShardedOptimizer& optimizer,
             const SaveOptions& options = {});
  ~SaveInStep();
  SaveInStep(const SaveInStep&) = delete;
  SaveInStep& operator=(const SaveInStep&) = delete;
  // Collective: completes and commits the checkpoint; returns its directory.
  std::string finish(const TrainState& state);
  // This rank's bytes written into the checkpoint during the step, so far.
  int64_t bytes_written_in_step() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// "latest" (or "") -> the directory root_dir/latest names; a path -> itself. Throws if that is not
// a committed checkpoint.
std::string resolve(const std::string& root_dir, const std::string& which);
// Reads and validates dir/train_state.json alone: no tensor, no collective (what load() returns,
// for a decision to take before loading). Throws CheckpointError naming the file and the field
// (the first problem check_train_state finds).
TrainState read_train_state(const std::string& dir);

// Note [train_state.json schema]
// The one schema of train_state.json, the file save() writes last: format_version (==
// kFormatVersion), step and samples_seen (integers >= 0), world_size (>= 1), strategy (a
// ShardingStrategy name), rng_states (one base64 RNG state per rank), extra (an object), optimizer
// {type: a string, state_names: non-empty strings, steps: {tensor: integer >= 0}}, files (the
// safetensors file names) and, optional (absent before it was recorded), commit_index (an integer
// >= 0: 1 + the largest commit_index in root_dir at the commit; SaveOptions::keep_last).
// check_train_state checks a parsed document against it and returns every problem found (empty:
// it holds), each "<where>field 'KEY' is VALUE, not WHAT" or "<where>field 'KEY' is missing".
// read_train_state and load() throw the first; fsdp-ckpt verify prints them all.
std::vector<std::string> check_train_state(const nlohmann::json& doc, const std::string& where);

// True when root_dir/latest names a committed checkpoint.
bool has_latest(const std::string& root_dir);

// Loads a checkpoint saved on any world size and strategy into `root` (and `optimizer`). Checks
// every name, shape and dtype against the model and fails naming the tensor and both values.
// Restores this rank's RNG state when the world size is unchanged. Collective.
TrainState load(const std::string& dir, FSDPModule& root, ShardedOptimizer* optimizer);

// Note [Importing weights]
// import_weights starts a sharded model from weights saved elsewhere, e.g. a Hugging Face model
// directory: `dir` holds model.safetensors, or model.safetensors.index.json and the files it
// names, with tensors named as the model's parameters (a tied parameter under any one of its
// names, so a missing lm_head.weight is fine when it is tied to the embedding) in BF16, F16 or F32.
// Every name, shape and dtype is checked first, and a missing, unexpected or mis-shaped tensor is
// refused with a CheckpointError naming it and its file, before any weight is read. Then every
// rank reads only the byte ranges of its own shards, converting them to the fp32 master shards in
// bounded chunks: no rank holds the whole model and nothing is broadcast. Collective (the ranks
// agree at the end, so a read that fails on one rank fails on all); the optimizer is untouched.
// On a model built on the meta device and not yet used, the root's lazy init that the import runs
// leaves the parameters it imports to it rather than filling them from FullyShardOptions::init
// first (which they then need not set); an import that fails leaves the model at its init values.
//
// Note [Grown rows]
// ImportOptions::grow_rows names tensors (by any of their names; a tied one once) that may hold
// more rows (dim 0) in the model than in the source, e.g. an embedding and an LM head for a
// vocabulary larger than the pretrained one. The source's rows are copied into the first rows and
// every added row is the mean of the source's rows, computed in fp64 from this rank's part of them
// and summed over the ranks (one all-reduce of a row per grown tensor), so no rank reads more than
// its shards. This is transformers' resize_token_embeddings default (mean_resizing=True) without
// its noise: transformers samples N(mean, 1e-9 * covariance), whose spread is about 3e-5 of the
// rows' own and below bf16 resolution; the mean itself is deterministic and independent of the
// world size. A source with more rows than the model's is refused.
struct ImportOptions {
  TORCH_ARG(std::vector<std::string>, grow_rows) = {};
  // Only the model's tensors for which this returns true (by their first name) are imported, the
  // others keep their values; null: every tensor. E.g. the base of a LoRA model, whose adapters no
  // pretrained checkpoint holds, or the adapters alone from a PEFT adapter file.
  TORCH_ARG(std::function<bool(const std::string& name)>, select) = nullptr;
  // The source names the model's tensors with this prefix (PEFT: "base_model.model.").
  TORCH_ARG(std::string, source_prefix) = "";
  // The source's file, or with ".index.json" its index (PEFT: "adapter_model.safetensors").
  TORCH_ARG(std::string, file_name) = "model.safetensors";
  // A bitsandbytes 4-bit weight imported into an NF4 stored form in the disk tier
  // (OffloadPolicy::params kDisk) keeps its codes where they are: each gather and save reads them
  // from the source's files, which stay open and must stay unchanged while the model lives; the
  // tier holds the absmax alone. False: the tier holds a copy of the codes too.
  TORCH_ARG(bool, codes_in_place) = true;
};

struct ImportReport {
  std::vector<std::string> files;  // the safetensors files, by plain name
  int64_t tensors = 0;             // imported tensors (tied ones once)
  uint64_t total_bytes = 0;        // their size in the files
  uint64_t bytes_read = 0;         // what this rank read of them
  std::string dtypes;              // the source dtypes, e.g. "BF16" or "BF16, F32"
  // Per grown tensor (Note [Grown rows]): "NAME: R -> M rows", R the source's, M the model's.
  std::vector<std::string> grown;
};
ImportReport import_weights(const std::string& dir, FSDPModule& root, const ImportOptions& options = {});

// The same source format and checks as import_weights, read into an ordinary, unsharded module
// (every parameter named as in its named_parameters(); a tied one under any of its names), each
// tensor converted to the parameter's dtype. E.g. a Hugging Face model directory run in LibTorch.
// Throws CheckpointError naming the file and tensor; the module is untouched unless all checks pass.
ImportReport import_unsharded(const std::string& dir, torch::nn::Module& module);

// Loads the model tensors of a checkpoint into an ordinary, unsharded module (names as in its
// named_parameters(); tied parameters under their first name). A checkpoint saved without the
// frozen parameters (SaveOptions::frozen_params off, e.g. a LoRA run's adapters) restores the
// trainable ones and leaves the frozen ones as they are: apply fsdp::lora to the module and import
// its base first (import_unsharded); fsdp::merge_lora can fold the adapters in after. Onto a module
// without adapters such a checkpoint is refused, saying so.
void load_unsharded(const std::string& dir, torch::nn::Module& module);

}  // namespace fsdp::checkpoint
