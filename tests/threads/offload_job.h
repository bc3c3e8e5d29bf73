// The small sharded job the offload tests train: 2 thread ranks, a 3-block Net whose shards stream
// through the disk tier in several chunks, AdamW, and the offload policies they compare.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <optional>
#include <string>

#include "fsdp/fsdp.h"
#include "support/models.h"
#include "support/sharded_model.h"

namespace fsdp::offload_job {

constexpr int kWorld = 2;
constexpr int64_t kGlobalBatch = 8;
// Three streamed tensors (param, exp_avg, exp_avg_sq) of 1024-element chunks, three chunks each:
// every shard of the model below streams in several chunks with a ragged last one.
constexpr int64_t kBudget = 3 * 3 * 1024 * 4;

inline testing::NetOptions net_options(bool meta) {
  testing::NetOptions o;
  o.in = 7;
  o.dim = 61;
  o.hidden = 333;  // a block holds ~41k params: ~20k per rank, 20 chunks of 1024
  o.out = 5;
  o.blocks = 3;
  o.device = meta ? at::Device(at::kMeta) : at::Device(at::kCPU);
  return o;
}

using Job = testing::ShardedModel;

// `offload` on the root only: the blocks inherit it. `checkpoint_block`: a block run under
// activation checkpointing.
inline Job build(DeviceMesh& mesh, const std::optional<OffloadPolicy>& offload, bool meta = true,
                 int checkpoint_block = -1) {
  testing::ShardedModelOptions o;
  o.net = net_options(meta);
  o.net.checkpoint_block = checkpoint_block;
  // The non-meta model's initial values come from the global generator, which the rank threads
  // share: seeded and drawn under a lock so that every rank (and every run) gets the same values.
  o.seed = 3;
  if (meta) o.shard.init(init::normal(0.2, 11));
  o.root_shard = o.shard;
  if (offload) o.root_shard->offload(*offload);
  o.adamw = AdamWOptions(1e-2).weight_decay(0.1);
  return testing::make_sharded_model(mesh, o);
}

inline double train_step(Job& j, int64_t step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + step);
  auto x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
  const int64_t local = kGlobalBatch / kWorld;
  return testing::train_on_batch(j, x.narrow(0, rank * local, local), y.narrow(0, rank * local, local),
                                 /*clip=*/0.5);
}

inline OffloadPolicy disk_policy(const std::string& dir, bool grads = false) {
  return OffloadPolicy()
      .params(OffloadTier::kDisk)
      .grads(grads ? OffloadTier::kDisk : OffloadTier::kNone)
      .optimizer_state(OffloadTier::kDisk)
      .dir(dir)
      .memory_budget_bytes(kBudget);
}

inline OffloadPolicy host_policy() {
  return OffloadPolicy().params(OffloadTier::kHost).grads(OffloadTier::kHost).optimizer_state(OffloadTier::kHost);
}

}  // namespace fsdp::offload_job
