// Offload choices: which tier each sharded state lives in, per unit (FullyShardOptions::offload in
// fsdp/options.h), and the disk tier's directory and memory budget. Part of the offload layer.
#pragma once

#include <cstdint>
#include <string>

#include <torch/arg.h>

namespace fsdp {

// Where a sharded state lives between uses (see fsdp/offload.h and docs/NOTES.md, "Offload").
enum class OffloadTier {
  kNone,  // with the compute device (RAM on CPU runs)
  kHost,  // host memory (pinned in CUDA builds); copied to the device before the all-gather
  kDisk,  // a file under OffloadPolicy::dir, memory-mapped; streamed through the optimizer step
};

const char* offload_tier_name(OffloadTier t);             // "none", "host", "disk"
OffloadTier parse_offload_tier(const std::string& name);  // throws ConfigError naming it

// Per-state offload choices for one unit. Unset on a unit: the root's policy. dir and
// memory_budget_bytes are per rank and taken from the root (one disk tier per rank).
struct OffloadPolicy {
  // The parameter shards: fp32 masters, and a frozen parameter's stored form (bf16, int8, NF4:
  // FullyShardOptions::frozen_storage), read from the disk tier for each gather when there.
  TORCH_ARG(OffloadTier, params) = OffloadTier::kNone;
  TORCH_ARG(OffloadTier, grads) = OffloadTier::kNone;            // fp32 gradient shards
  TORCH_ARG(OffloadTier, optimizer_state) = OffloadTier::kNone;  // e.g. AdamW exp_avg, exp_avg_sq
  // Directory for the disk tier's files (created if missing; must be writable).
  TORCH_ARG(std::string, dir) = "";
  // The most bytes of disk-tier state mapped in memory at once while the optimizer streams
  // through it; 0: chunks of 4 MiB per state tensor streamed, three chunks at most (read-ahead,
  // current, write-behind).
  TORCH_ARG(int64_t, memory_budget_bytes) = 0;

 public:  // TORCH_ARG leaves the access private
  bool uses(OffloadTier t) const { return params_ == t || grads_ == t || optimizer_state_ == t; }
  bool any() const { return uses(OffloadTier::kHost) || uses(OffloadTier::kDisk); }
  // Throws ConfigError naming the field ("offload.dir", ...) when the policy is inconsistent.
  void validate() const;
};

}  // namespace fsdp
