// Residency: where one flat param's sharded states live and how they move between the tiers, the
// single owner of that question. It holds the fp32 master shard (in its tier), the working copy
// in param_dtype when the master follows an offloaded optimizer state, the disk-tier master's
// read issued ahead of its gather, the reads kept for a later gather or the step (Note [Kept
// master reads] in sharded_unit.cpp), and it places the gradient shard. FlatParam asks it what to
// gather (gather_input) and tells it when the gather is done (gather_done); it never touches a
// tier itself.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "fsdp/frozen_storage.h"
#include "fsdp/offload_policy.h"
#include "offload/placement.h"
#include "offload/tier_tensors.h"

namespace fsdp::offload {

class DeviceStager;

// Where a flat param's sharded states live (FullyShardOptions::offload, resolved by the root's
// lazy init). See src/offload/ and Note [Host tier schedule].
struct OffloadPlacement {
  OffloadTier params = OffloadTier::kNone;
  OffloadTier grads = OffloadTier::kNone;
  OffloadTier optimizer_state = OffloadTier::kNone;
  std::shared_ptr<offload::DiskTier> disk;        // set when a state is in the disk tier
  std::shared_ptr<offload::DeviceStager> stager;  // host tier; disk tier on a device
};

// What becomes of a disk-tier master read for a gather (Note [Kept master reads]).
enum class KeepMaster : int {
  kNo,
  kForBackward,  // forward: kept for the unit's backward gather, counted against the budget
  kForStep,      // backward: kept for the step that follows (take_master_for_step)
};

class Residency {
 public:
  struct Config {
    at::ScalarType compute_dtype = at::kFloat;  // what the all-gather moves
    c10::Device device = c10::Device(c10::kCPU);
    bool requires_grad = true;
    // The master is a frozen param's stored form (Note [Frozen storage], kernels/cpu/blocks.cpp): gathered as
    // it is, never stepped; in the host tier, or the disk tier read for each gather (Note [A stored
    // form in the disk tier]).
    bool stored = false;
    std::string tag;      // "layers.0/0": names the states in errors and traces
    int64_t values = -1;  // the master's elements that hold parameters (the rest is padding); -1: all
  };
  // Takes the master shard as built (fp32 on the compute device, not offloaded).
  Residency(at::Tensor master, Config config);

  void set_tag(std::string tag) { config_.tag = std::move(tag); }
  // Moves the states to `placement`'s tiers, once (the root's lazy init). `materialized`: the
  // master holds values (else deferred init fills it later, and nothing is copied).
  void place(OffloadPlacement placement, bool materialized);
  const OffloadPlacement& placement() const { return placement_; }

  // The fp32 master shard, in its tier: what the optimizer steps and checkpoints save.
  at::Tensor& master() { return master_; }
  const at::Tensor& master() const { return master_; }
  // Note [The master follows the optimizer state] (flat_param.h).
  bool master_follows_state() const { return follows_; }
  // Each state's tier, the master's once it follows its state (Note [Placement rules]).
  StateTiers tiers() const {
    return {follows_ ? placement_.optimizer_state : placement_.params, placement_.grads, placement_.optimizer_state,
            follows_};
  }
  const at::Tensor& working() const { return working_; }
  // A zero-filled tensor of `dtype` (fp32, or bf16 in RAM or the host tier) shaped like the master
  // shard, in the optimizer state's tier.
  at::Tensor new_state_tensor(const std::string& what, at::ScalarType dtype = at::kFloat);

  // ---- the gather
  // The all-gather's input: the shard in compute dtype on the compute device (a kept read, a read
  // through the disk tier's I/O threads, the working copy, or the master itself).
  at::Tensor gather_input(KeepMaster keep);
  // The gather has read its input: a disk-tier master's pages leave memory.
  void gather_done();
  // Disk tier: starts reading the master for the next gather (no-op when nothing is to read).
  void read_ahead();
  // The master's values a backward gather kept for the step, handed over once.
  at::Tensor take_master_for_step();

  // ---- the master's writers
  // Elements of the master were written (deferred init: one parameter's part): they leave memory.
  void part_written(const at::Tensor& part);
  // Deferred init filled the master: the working copy follows.
  void materialized() {
    if (follows_) refresh_working(0, master_);
  }
  // A stored frozen master gets a new stored form (its values were written), in its tier.
  void replace_stored(at::Tensor stored);
  // Bytes of a stored master were written in place (a load's range): in the disk tier, they leave
  // memory, and no read issued before them is used.
  void stored_written();
  // A new stored form of `numel` elements of `dtype`, its bytes to be written in place (a load's
  // ranges): in the disk tier a fresh file range, never copied.
  void allocate_stored(at::ScalarType dtype, int64_t numel);
  // The same from fp32 `values`; with `in_place`, encoded into the stored form when it is there (a
  // load or an import holds no second stored form beside the old: Note [The load and the save]).
  void encode_stored(FrozenStorage storage, const at::Tensor& values, bool in_place);
  // The master was written outside the optimizer (a checkpoint load, deferred init): drops kept
  // reads, marks pending ones stale, refreshes the working copy.
  void master_written();
  // A load wrote the master's elements [begin, begin + part's) with `part` (fp32 host values): the
  // working copy is cast from them now, and master_written() reads the master back only if some
  // element was written otherwise.
  void values_written(int64_t begin, const at::Tensor& part);
  // Null, or what brings the working copy up to date after the optimizer updated elements [a, b).
  std::function<void(int64_t a, int64_t b, const at::Tensor& updated)> after_update();

  // ---- bytes of a stored form read in place (Note [NF4 codes read in place] in residency.cpp)
  // A stored form in the disk tier (its file allocated by allocate_stored or not yet).
  bool stored_in_disk_tier() const { return config_.stored && placement_.params == OffloadTier::kDisk; }
  // Bytes [at, at + bytes) of the stored form are `file`'s from `offset` on: every read of the
  // stored form takes them there; the tier's blocks under them go at punch_in_place().
  void read_in_place(int64_t at, int64_t bytes, std::shared_ptr<const io::File> file, int64_t offset);
  void punch_in_place();
  int64_t in_place_bytes() const;
  // The disk tier's tracer (null without a disk tier or a tracer): the gather's decode is traced there.
  Tracer* tracer() const { return placement_.disk ? placement_.disk->tracer() : nullptr; }
  // Bytes [a, b) of the stored form are about to be written: the ranges read in place that
  // overlap them stop being read there (copied into the tier first unless [a, b) covers them).
  void before_stored_write(int64_t a, int64_t b);
  // The stored form's bytes, all of them readable (a save's decode): a read through the tier when
  // some are read in place, else the master itself.
  at::Tensor stored_bytes() const;

  // ---- the gradient shard
  // The reduce-scatter's output, brought to host memory when gradients live in the host tier.
  at::Tensor stage_reduced(const at::Tensor& reduce_output);
  // Moves the gradient shard to its tier (the first time) and lets its disk pages go.
  void place_grad(at::Tensor& grad);
  // The gradient shard was zeroed: its disk pages go.
  void grad_written(const at::Tensor& grad);
  // What the optimizer reads: the gradient shard, or its host copy when the master follows state.
  at::Tensor grad_for_step(const at::Tensor& grad);

 private:
  bool crosses_to_device(OffloadTier tier) const;
  at::Tensor fetch_master();
  void start_master_read();
  void refresh_working(int64_t a, const at::Tensor& master_part);  // working_[a, ...) from the master's values
  void cast_into_working(int64_t a, const at::Tensor& part);       // part: fp32 host values of working_[a, ...)
  void move_master_to_state_tier(bool materialized);

  at::Tensor master_;
  Config config_;
  OffloadPlacement placement_;
  bool follows_ = false;
  int64_t fresh_ = 0;               // elements values_written() cast into the working copy since master_written()
  at::Tensor working_;              // [shard] param_dtype on the compute device when follows_
  offload::IoTicket pending_read_;  // read_ahead()'s read of the master
  uint64_t pending_read_generation_ = 0;
  at::Tensor kept_master_;  // a disk-tier master's values read for a gather, kept (KeepMaster)
  // A stored master in the disk tier: the tier's fp32 words that hold its bytes (master_ is their
  // view in the stored dtype); what the tier's I/O threads read.
  at::Tensor stored_words_;
  std::vector<InPlaceRange> in_place_;  // sorted by `at`, disjoint
};

}  // namespace fsdp::offload
