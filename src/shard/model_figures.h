// What the memory figures above the shard layer (memory_report, offload_plan, offload_io,
// disk_tier_stats: src/optim/memory.cpp) see of a sharded model: for each flat param, where its
// states live (Note [Placement rules]), its sizes, how often a training step like the last one
// gathers it, and what it holds now; and the rank's tiers. Plain data: nothing here exposes a
// unit or a flat param.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/fully_shard.h"
#include "offload/placement.h"

namespace fsdp {

namespace offload {
class DiskTier;
class DeviceStager;
}  // namespace offload

struct FlatFigures {
  offload::StateTiers where;
  offload::FlatParamKind kind;
  // Sizes, gathers per step, whether the forward read of a disk-tier master is kept, the device;
  // state_tensors and step_in_backward are the optimizer's, left to the caller.
  offload::FlatParamIo io;
  at::Tensor master, working, grad;                   // working: when the master follows its state; grad: once reduced
  int64_t gathered_bytes = 0, grad_buffer_bytes = 0;  // alive now
  int64_t partial_grad_bytes = 0;  // sums waiting for the replicas' all-reduce (set_requires_all_reduce)
  int64_t in_place_bytes = 0;      // of a disk-tier stored form, read from imported files (no tier blocks)
};

struct ModelFigures {
  std::vector<FlatFigures> flats;  // flat-index order
  int64_t peak_gathered_bytes = 0;
  offload::DiskTier* disk_tier = nullptr;  // null when no state is in the disk tier
  offload::DeviceStager* stager = nullptr;
};

// The figures of the model under `root` (lazily initialising an unclaimed root: its tiers open
// and its states are placed, as for its first forward).
ModelFigures model_figures(FSDPModule& root);

}  // namespace fsdp
