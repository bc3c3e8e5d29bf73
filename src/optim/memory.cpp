// The memory figures of a sharded model (fsdp/memory.h, fsdp/offload.h): memory_report (what is
// held now), offload_plan (what the offload tiers will hold and move per step, by the placement
// rules: Note [Placement rules]), offload_io (what they moved) and disk_tier_stats, from the shard
// layer's facts (shard/model_figures.h) and the optimizer's state.
#include <ATen/DeviceAccelerator.h>

#include <algorithm>
#include <sstream>

#include "base/strings.h"
#include "fsdp/errors.h"
#include "fsdp/memory.h"
#include "fsdp/offload.h"
#include "fsdp/optim.h"
#include "buffers/buffer_storage.h"
#include "offload/device_stager.h"
#include "offload/placement.h"
#include "offload/tier_tensors.h"
#include "shard/grad_shards.h"
#include "shard/model_figures.h"

namespace fsdp {
namespace {

// Adds a sharded state's bytes to the tier it lives in (a disk-backed tensor counts as disk
// whatever `tier` says).
void count_in_tier(MemoryReport& r, const at::Tensor& t, OffloadTier tier) {
  const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
  if (offload::is_disk_backed(t)) {
    r.tier_disk += n;
  } else if (tier == OffloadTier::kHost) {
    r.tier_host += n;
  } else {
    r.tier_device += n;
  }
}

}  // namespace

std::string MemoryReport::to_string() const {
  std::ostringstream s;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  s.precision(3);
  s << std::fixed << "params " << mib(sharded_params) << " MiB, grads " << mib(sharded_grads) << " MiB, optimizer "
    << mib(optimizer_state) << " MiB, gathered now " << mib(unsharded_alive) << " MiB (peak " << mib(peak_unsharded)
    << " MiB)";
  if (tier_host > 0 || tier_disk > 0) {
    s << "; by tier: device " << mib(tier_device) << " MiB, host " << mib(tier_host) << " MiB, disk " << mib(tier_disk)
      << " MiB (" << mib(disk_resident) << " MiB of it in memory now)";
  }
  if (device_peak_reserved > 0) {
    s << "; device peak " << mib(device_peak_allocated) << " MiB allocated, " << mib(device_peak_reserved)
      << " MiB reserved";
  }
  return s.str();
}

MemoryReport memory_report(FSDPModule& root, const ShardedOptimizer* optimizer) {
  MemoryReport r;
  const ModelFigures m = model_figures(root);
  for (const FlatFigures& f : m.flats) {
    r.sharded_params += f.master.numel() * f.master.element_size();
    count_in_tier(r, f.master, f.where.master);
    if (f.working.defined()) {  // the working copy in param_dtype, with compute
      r.sharded_params += f.working.numel() * f.working.element_size();
      count_in_tier(r, f.working, OffloadTier::kNone);
    }
    if (f.grad.defined()) {
      r.sharded_grads += f.grad.numel() * f.grad.element_size();
      count_in_tier(r, f.grad, f.where.grads);
    }
    r.partial_grads += f.partial_grad_bytes;  // in memory, whatever the gradient shard's tier
    r.unsharded_alive += f.gathered_bytes + f.grad_buffer_bytes;
    r.unsharded_grads_alive += f.grad_buffer_bytes;
  }
  r.peak_unsharded = m.peak_gathered_bytes;
  if (std::any_of(m.flats.begin(), m.flats.end(), [](const FlatFigures& f) { return !f.io.device_is_cpu; })) {
    const auto stats = at::accelerator::getDeviceStats(at::accelerator::getDeviceIndex());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    r.device_peak_allocated = stats.allocated_bytes[all].peak;
    r.device_peak_reserved = stats.reserved_bytes[all].peak;
  }
  if (m.disk_tier != nullptr) r.disk_resident = m.disk_tier->resident_bytes();
  if (optimizer == nullptr) return r;
  for (const auto& s : optimizer->states()) {
    for (const auto& [name, t] : s.tensors) {
      if (t.defined()) count_in_tier(r, t, m.flats.at(s.flat_index).where.optimizer_state);
    }
  }
  r.optimizer_state = optimizer->state_bytes();
  return r;
}

std::string OffloadPlan::to_string() const {
  auto b = [](int64_t bytes) { return base::mib(bytes, 1); };
  return "holds: device " + b(device_bytes) + ", host " + b(host_bytes) + ", disk " + b(disk_bytes) +
         "; moves per step: " + per_step.to_string();
}

OffloadPlan offload_plan(FSDPModule& root, const ShardedOptimizer& optimizer) {
  OffloadPlan plan;
  for (FlatFigures f : model_figures(root).flats) {
    f.io.state_tensors = static_cast<int>(optimizer.state_names().size());
    f.io.state_element_bytes = static_cast<int>(c10::elementSize(optimizer.state_dtype()));
    f.io.step_in_backward = optimizer.steps_in_backward();
    const offload::TierBytes held = offload::state_bytes(f.where, f.kind, f.io);
    plan.device_bytes += held[OffloadTier::kNone];
    plan.host_bytes += held[OffloadTier::kHost];
    plan.disk_bytes += held[OffloadTier::kDisk] - f.in_place_bytes;  // read from imported files
    const offload::StepIo io = offload::step_io(f.where, f.kind, f.io);
    plan.per_step.disk_read += io.disk_read;
    plan.per_step.disk_write += io.disk_write;
    plan.per_step.to_device += io.to_device;
    plan.per_step.to_host += io.to_host;
  }
  return plan;
}

OffloadIo offload_io(FSDPModule& root) {
  OffloadIo io;
  const ModelFigures m = model_figures(root);
  if (m.disk_tier != nullptr) {
    const auto c = m.disk_tier->io_counters();
    io.disk_read = c.bytes_read;
    io.disk_write = c.bytes_written;
  }
  if (m.stager != nullptr) {
    io.to_device = m.stager->bytes_to_device();
    io.to_host = m.stager->bytes_to_host();
  }
  return io;
}

void release_host_memory() { buffers::release_freed_host_blocks(); }

DiskTierStats disk_tier_stats(FSDPModule& root) {
  DiskTierStats s;
  offload::DiskTier* tier = model_figures(root).disk_tier;
  if (tier == nullptr) return s;
  s.dir = tier->dir();
  s.file_bytes = tier->file_bytes();
  s.resident_bytes = tier->resident_bytes();
  s.peak_resident_bytes = tier->peak_resident_bytes();
  s.budget_bytes = tier->budget_bytes();
  try {
    s.chunk_bytes = tier->chunk_elements(3) * static_cast<int64_t>(sizeof(float));
  } catch (const ConfigError&) {
    s.chunk_bytes = 0;  // a budget too small to stream: the step says so when it runs
  }
  return s;
}

}  // namespace fsdp
