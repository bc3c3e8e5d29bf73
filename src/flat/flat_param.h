// FlatParam: the parameters of one unit that share (dtype, requires_grad, optimizer group),
// concatenated in registration order into one flat buffer padded to a multiple of the shard group
// size. Rank r of the shard group owns elements [r*S, (r+1)*S) as an fp32 master shard.
//
// Note [Flat buffer lifetime]
// The unsharded buffer is allocated once. Each parameter is a leaf whose data is a view of it
// (Tensor::set_data keeps the parameter's identity, hooks and autograd metadata). Resharding frees
// the memory by resizing the buffer's storage to zero bytes; unsharding grows it back and
// all-gathers into it. Views see the new memory because they share the storage object (so do
// views autograd saved for backward). While resharded, parameter data must not be read: the
// parameters point at guards instead (Note [Guarded parameters], param_data.h), and back at their
// views once the gather lands. Gradients are views of an unsharded gradient buffer managed the
// same way, assigned before the unit's backward so that AccumulateGrad adds into them in place,
// and reduce-scattered without a copy.
//
// A FlatParam is a composition, each part owning its state and documented where it is declared:
// the layout (flat_layout.h), where the sharded states live (offload/residency.h), a frozen
// shard's stored form (flat/stored_shard.h), the gathered buffer (gathered_params.h) and the
// gradient cycle (grad_cycle.h). What remains here is the flat param's life from its build
// through deferred init or a load to the optimizer's step, which touches several parts at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flat/flat_layout.h"
#include "flat/gathered_params.h"
#include "flat/grad_cycle.h"
#include "fsdp/frozen_storage.h"
#include "fsdp/param_init.h"
#include "flat/stored_shard.h"

namespace fsdp {
namespace offload {
struct OffloadPlacement;
struct StateTiers;
}  // namespace offload
using offload::KeepMaster;
using offload::OffloadPlacement;
using offload::Residency;

class FlatParam {
 public:
  // Lays out `entries` and builds this rank's master shard from the parameters' current values;
  // parameters on the meta device wait for materialize().
  FlatParam(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
            Communicator& replicate_group);
  ~FlatParam();

  // Deferred init: fills the master shard from `init`. Names passed are `prefix + entry.name`.
  // With `load_writes` (a load that writes every element follows: Note [Deferred init leaves what
  // a load writes] in unit_init.cpp) nothing is written: the values wait for that load, whose
  // master_written() or store_frozen() ends the wait; a later call without it fills them.
  void materialize(const ParamInitFn& init, const std::string& prefix, bool load_writes = false);
  bool awaits_load() const { return awaits_load_; }
  bool needs_materialize() const { return needs_materialize_; }  // meta: deferred init or a load fills it

  // Moves the sharded states to their tiers (before materialize(), so deferred init writes
  // straight into them). Called once, by the root's lazy init.
  void set_offload(OffloadPlacement placement);
  // Where the sharded states live and how they move: the one owner of that.
  const Residency& residency() const { return *residency_; }
  const OffloadPlacement& offload() const;
  // A zero-filled tensor of `dtype` shaped like the master shard, in the optimizer state's tier.
  at::Tensor new_state_tensor(const std::string& what, at::ScalarType dtype = at::kFloat);
  // Note [The master follows the optimizer state] (offload/residency.h).
  bool master_follows_state() const;
  offload::StateTiers state_tiers() const;               // each state's tier (Note [Placement rules])
  at::Tensor& sharded_param();                           // fp32 master shard (a frozen one's stored form)
  at::Tensor& sharded_grad() { return grads_.shard(); }  // fp32, undefined until the first reduce

  // ---- a frozen param kept in a stored form (flat/stored_shard.h)
  bool stores_frozen() const { return stored_.active(); }
  void frozen_values_into(const at::Tensor& out) const;  // fp32 values, shard_numel(), for a save
  void store_frozen(const at::Tensor& values);           // fp32 values, shard_numel(): a load
  // A load range by range, no fp32 copy (StoredShard::store_range, store_codes_in_place); end_store_values() ends it.
  void store_values(int64_t begin, const at::Tensor& values);
  bool store_codes_in_place(int64_t begin, int64_t count, const CodesInFile& codes);
  bool values_stored() const { return stored_.ranges_stored(); }
  void end_store_values();
  int64_t stored_bytes() const;  // bytes of the stored shard
  // ---- the optimizer's side (through shard/grad_shards.h)
  // Collects the gradient and returns what the optimizer reads: the gradient shard, or its host
  // copy when the master follows the state. Undefined when the flat param has no gradient yet.
  at::Tensor optimizer_grad();
  // Null, or what brings the working copy up to date after the optimizer updated elements
  // [a, b) of the master (their new values in `updated`, host memory).
  std::function<void(int64_t a, int64_t b, const at::Tensor& updated)> after_optimizer_update();
  // The master was written outside the optimizer (a checkpoint load): refresh what derives from it.
  void master_written();
  // A load wrote elements [begin, ...) of the master with `values` (fp32, host) before its
  // master_written(): what derives from them is made from these (Residency::values_written).
  void values_written(int64_t begin, const at::Tensor& values);
  // Disk tier: starts reading the master shard for the next all-gather (Note [Disk tier I/O
  // threads]); the gather uses it unless the master changed since.
  void read_ahead();
  // The master's values a gather kept for the step, handed over once; undefined when none.
  at::Tensor take_master_for_step();

  // ---- layout
  const FlatLayout& layout() const { return layout_; }
  const std::vector<FlatParamEntry>& entries() const { return layout_.entries(); }
  const FlatParamConfig& config() const { return layout_.config(); }
  void set_tag(std::string tag);
  int64_t numel() const { return layout_.numel(); }
  int64_t padded_numel() const { return layout_.padded_numel(); }
  int64_t shard_numel() const { return layout_.shard_numel(); }
  int64_t shard_offset() const { return layout_.shard_offset(); }
  int64_t values_in_shard() const { return layout_.values_in_shard(); }
  Communicator& shard_group() const { return layout_.shard_group(); }
  Communicator& replicate_group() const { return layout_.replicate_group(); }

  // ---- the gathered buffer (gathered_params.h) and the gradient cycle (grad_cycle.h)
  GatheredParams& gathered() { return gathered_; }
  const GatheredParams& gathered() const { return gathered_; }
  GradCycle& grads() { return grads_; }
  const GradCycle& grads() const { return grads_; }
  const at::Tensor& working_shard() const;  // Note [The master follows the optimizer state]
  ShardedState state() const { return gathered_.state(); }
  // Issues the all-gather (returns at once); wait_for_unshard() makes the params usable. `keep`:
  // what becomes of a disk-tier master read for it (Note [Kept master reads] in sharded_unit.cpp).
  void unshard(KeepMaster keep);
  void unshard();
  void wait_for_unshard() { gathered_.wait(); }
  void reshard() { gathered_.reshard(); }
  // Calls `fn` with this rank's shard, read from its tier, for computing on the shard instead of
  // gathering it (shard/table_shard.h): in its floating stored dtype, or decoded whole into the
  // compute dtype from int8 or NF4 blocks.
  void with_shard_values(const std::function<void(const at::Tensor&)>& fn);
  int64_t unsharded_bytes() const { return gathered_.bytes(); }  // bytes held now
  int64_t unsharded_grad_bytes() const { return grads_.buffer_bytes(); }

 private:
  void loaded();

  FlatLayout layout_;
  StoredShard stored_;
  std::unique_ptr<Residency> residency_;  // the master shard and where every state lives
  GatheredParams gathered_;
  GradCycle grads_;
  bool needs_materialize_ = false;  // built on the meta device: deferred init or a load fills it
  bool awaits_load_ = false;        // materialize(.., load_writes): a load writes the values
};

}  // namespace fsdp
