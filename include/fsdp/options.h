// User options for fully_shard, LibTorch style: chained TORCH_ARG setters, validated once when
// fully_shard is called, with messages that name the bad value.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp/mixed_precision.h"
#include "fsdp/frozen_storage.h"
#include "fsdp/offload_policy.h"
#include "fsdp/param_init.h"

namespace fsdp {

enum class ShardingStrategy {
  kFullShard,    // ZeRO-3: params, grads and optimizer state sharded; params freed after use
  kShardGradOp,  // ZeRO-2: like kFullShard but params stay gathered from forward to backward
  kNoShard,      // DDP-equivalent: every rank keeps everything; gradients all-reduced
  kHybridShard,  // kFullShard within a row of a 2-D mesh, replicated (all-reduce) across rows
};
// kFullShard and kShardGradOp shard over a 1-D mesh (every rank); on a 2-D mesh fully_shard
// throws ConfigError rather than guess: kHybridShard is the strategy for a 2-D mesh.

const char* strategy_name(ShardingStrategy s);
ShardingStrategy parse_strategy(const std::string& name);  // "FULL_SHARD", "full_shard", ...

// Which optimizer group a parameter belongs to. Parameters of different groups live in different
// flat buffers, so a group's hyper-parameters (e.g. no weight decay) apply to whole buffers.
// The default puts parameters with fewer than 2 dims (norm weights, biases) in group 1 (no decay)
// and the rest in group 0.
using ParamGroupFn = std::function<int(const std::string& name, const at::Tensor& param)>;
int default_param_group(const std::string& name, const at::Tensor& param);

// How each frozen parameter is stored, by its name (relative to the unit's module) and tensor.
using FrozenStorageFn = std::function<FrozenStorage(const std::string& name, const at::Tensor& param)>;

// Picks parameters by their name (relative to the unit's module) and tensor.
using ParamPredicate = std::function<bool(const std::string& name, const at::Tensor& param)>;

// How persistent buffers (BatchNorm's running statistics and the like) are kept consistent across
// the ranks of the job, as DDP's broadcast_buffers does: once at the root's lazy init, then at the
// end of each backward after a training forward of the root (or at its next forward when no
// backward came), so every rank ends a step with the same buffers.
enum class BufferSync {
  kBroadcast,  // every rank takes rank 0's values (DDP's broadcast_buffers)
  kAverage,    // the mean over the ranks (integer buffers, such as counters, are broadcast)
  kLocal,      // left alone: each rank keeps its own
};

const char* buffer_sync_name(BufferSync s);  // "broadcast", "average", "local"

// Buffers, read on the root. LibTorch has no notion of a non-persistent buffer (Python's
// register_buffer(..., persistent=False)), so it is declared here: a non-persistent buffer is
// never synchronised, cast or saved. Every other buffer is persistent: synchronised by `sync`,
// cast by its unit's MixedPrecisionPolicy::buffer_dtype, saved in checkpoints next to the
// parameters under its name and restored on load.
struct BufferPolicy {
  TORCH_ARG(BufferSync, sync) = BufferSync::kBroadcast;
  // Names as the root module's named_buffers() gives them, e.g. "rope.inv_freq"; each must exist.
  TORCH_ARG(std::vector<std::string>, non_persistent) = {};
};

struct FullyShardOptions {
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::kFullShard;
  // Default: true for kFullShard and kHybridShard, false for kShardGradOp and kNoShard.
  TORCH_ARG(std::optional<bool>, reshard_after_forward) = std::nullopt;
  // reshard_after_forward as a group size (FSDP2's int; ZeRO++'s hpZ): after forward, the unit's
  // params stay sharded over groups of this many consecutive ranks of its shard group (the ranks
  // of one node), each rank keeping 1/group of them (in the compute dtype, or a frozen int8 / NF4
  // base in its stored form), so that backward's all-gather runs inside the group. 0: off
  // (reshard_after_forward alone decides). 1 keeps the params whole, as reshard_after_forward
  // false; the shard group's size is reshard_after_forward true. Any other value must divide the
  // shard group's size, and needs reshard_after_forward true or unset. Exact: backward computes
  // with the same values. Note [Resharding to a group].
  TORCH_ARG(int, reshard_after_forward_group) = 0;
  // Parameters kept whole on every rank instead of sharded, their gradients all-reduced over every
  // rank as DDP does, in a flat param of their own (e.g. LoRA's adapters:
  // [](const std::string& n, const at::Tensor&) { return fsdp::is_lora_adapter(n); }). Small
  // trainable parameters beside a large frozen base cost more in the latency of their gathers and
  // reductions than they save in memory. Null: none. Checkpoints hold them like any parameter.
  TORCH_ARG(ParamPredicate, replicate_params) = nullptr;
  // Mixed precision (fsdp/mixed_precision.h): the dtypes this unit computes, reduces and returns
  // in. Master shards stay fp32.
  TORCH_ARG(MixedPrecisionPolicy, mp_policy) = MixedPrecisionPolicy();
  TORCH_ARG(ParamGroupFn, param_group) = default_param_group;
  // Required when the module's parameters are on the meta device (deferred init).
  TORCH_ARG(ParamInitFn, init) = nullptr;
  // Units whose all-gather is issued ahead: when a unit's forward starts, the next
  // prefetch_depth units' (by the order recorded in the previous step); when its backward starts,
  // the next prefetch_depth units' in backward order. 0 turns prefetching off. Unset: the root's
  // setting, else 1.
  TORCH_ARG(std::optional<int>, prefetch_depth) = std::nullopt;
  // On the root: at most this many units gathered at once counting prefetches (0: no cap). A
  // prefetch that would exceed it is skipped; a unit that must run is always gathered.
  TORCH_ARG(int, max_unsharded_units) = 0;
  // Offloading of this unit's sharded states. Unset: the root's policy, else nothing offloaded.
  TORCH_ARG(std::optional<OffloadPolicy>, offload) = std::nullopt;
  // On the root: how buffers are synchronised and which are non-persistent (BufferPolicy above).
  TORCH_ARG(BufferPolicy, buffers) = BufferPolicy();
  // How frozen parameters are stored (FrozenStorage above). Null: in the compute dtype. Each unit
  // applies its own (give every fully_shard call the same one). A frozen shard in a stored form
  // other than fp32 goes to the host tier when the params are offloaded (host or disk tier).
  TORCH_ARG(FrozenStorageFn, frozen_storage) = nullptr;
  // A frozen [vocab, dim] table (an embedding, an output head, or one tensor that is both) that is
  // never gathered: each rank computes on the part of the table its shard holds, through
  // fsdp::sharded_embedding and fsdp::sharded_cross_entropy (fsdp/vocab_parallel.h), and the
  // module is not run through fsdp::call. The module must hold one frozen 2-D parameter. A module
  // outside the unit that shares the tensor (a tied head) may use it through those functions.
  TORCH_ARG(bool, vocab_parallel) = false;
};

}  // namespace fsdp
