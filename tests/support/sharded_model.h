// The setup most sharding, checkpoint, fault and offload tests start from: a model whose blocks
// and root are fully_shard'ed (blocks first, as a user does), with an AdamW over the root, and
// one training step on a batch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "fsdp/device_mesh.h"
#include "fsdp/fully_shard.h"
#include "fsdp/optim.h"
#include "fsdp/options.h"
#include "support/models.h"

namespace fsdp::testing {

template <class Model>
struct BasicShardedModel {
  Model model{nullptr};
  std::shared_ptr<FSDPModule> root;
  std::unique_ptr<AdamW> optim;
};
using ShardedModel = BasicShardedModel<Net>;

struct ShardedModelOptions {
  NetOptions net;  // shapes and device (at::kMeta: values only from shard's init)
  // Seeds the global generator right before the Net draws its initial values, under a lock that
  // every caller in this process shares: rank threads draw the same values, run after run.
  std::optional<uint64_t> seed;
  std::optional<at::Device> move_to;  // the Net is built on net.device, then moved here
  FullyShardOptions shard;            // every block's, and the root's unless root_shard is set
  std::optional<FullyShardOptions> root_shard;
  AdamWOptions adamw = AdamWOptions(1e-2);
};

// Shards model->blocks, then the root, and makes the optimizer.
template <class Model>
BasicShardedModel<Model> shard_model(Model model, DeviceMesh& mesh, const FullyShardOptions& shard,
                                     const FullyShardOptions& root_shard, const AdamWOptions& adamw) {
  BasicShardedModel<Model> m;
  m.model = std::move(model);
  for (auto& b : m.model->blocks) fully_shard(b, mesh, shard);
  m.root = fully_shard(m.model, mesh, root_shard);
  m.optim = std::make_unique<AdamW>(m.root, adamw);
  return m;
}

ShardedModel make_sharded_model(DeviceMesh& mesh, const ShardedModelOptions& options = {});

// One step: mse_loss(model(x), y) backward, the gradient norm clipped to `clip` when given, the
// optimizer's step and zero_grad. Returns the loss.
template <class Model>
double train_on_batch(BasicShardedModel<Model>& m, const at::Tensor& x, const at::Tensor& y,
                      std::optional<double> clip = std::nullopt) {
  at::Tensor loss = at::mse_loss(fsdp::call(m.model, x), y);
  loss.backward();
  if (clip) clip_grad_norm(*m.root, *clip);
  m.optim->step();
  m.optim->zero_grad();
  return loss.item<double>();
}

}  // namespace fsdp::testing
