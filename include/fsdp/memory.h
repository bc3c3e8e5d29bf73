// Per-rank memory by category for a sharded model, measured from the buffers themselves.
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/fully_shard.h"

namespace fsdp {

class ShardedOptimizer;

struct MemoryReport {
  int64_t sharded_params = 0;  // fp32 master shards
  int64_t sharded_grads = 0;   // fp32 gradient shards
  // fp32 sums of reduce-scattered gradients waiting for the replicas' all-reduce
  // (FSDPModule::set_requires_all_reduce(false) under hybrid sharding)
  int64_t partial_grads = 0;
  int64_t optimizer_state = 0;  // e.g. AdamW exp_avg + exp_avg_sq shards
  int64_t unsharded_alive = 0;  // gathered param and gradient buffers alive now
  int64_t peak_unsharded = 0;   // the most gathered bytes alive at once so far
  // Of unsharded_alive, the gradient buffers: between the micro-batches of no-sync accumulation,
  // every unit's unreduced gradients.
  int64_t unsharded_grads_alive = 0;
  // The sharded states above (params + grads + optimizer state) by where they live (fsdp/offload.h):
  int64_t tier_device = 0;    // not offloaded: device memory (RAM on CPU runs)
  int64_t tier_host = 0;      // host tier: host memory (pinned with CUDA)
  int64_t tier_disk = 0;      // disk tier: bytes in files under offload.dir
  int64_t disk_resident = 0;  // of the disk tier, pages in memory now
  // With the model on an accelerator (CUDA), its caching allocator's high-water marks on the
  // current device since the process started (or since the allocator's peaks were last reset):
  // what the model, its activations and everything else the process allocated there needed at
  // most (allocated), and what the allocator held from the device for it (reserved). 0 on the CPU.
  int64_t device_peak_allocated = 0, device_peak_reserved = 0;
  int64_t model_state() const { return sharded_params + sharded_grads + optimizer_state; }
  std::string to_string() const;
};

MemoryReport memory_report(FSDPModule& root, const ShardedOptimizer* optimizer = nullptr);

// Returns to the system the host memory this process keeps freed: the gather buffers kept for
// reuse and the heap's free pages. A save or a load does it first; call it before resetting a
// peak-RSS watermark to measure what follows alone (fsdp-train does, before a save).
void release_host_memory();

}  // namespace fsdp
