// Gradient clipping by the global norm across every shard of every unit.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "fsdp/errors.h"
#include "fsdp/optim.h"
#include "kernels/ops.h"
#include "shard/grad_shards.h"
#include "shard/post_reduce_hook.h"

namespace fsdp {

double clip_grad_norm(FSDPModule& root, double max_norm) {
  if (!(max_norm > 0)) throw ConfigError("fsdp: clip_grad_norm needs max_norm > 0, got " + std::to_string(max_norm));
  GradShards shards(root);
  if (applies_gradients(shards.hook())) {
    throw UsageError(
        "fsdp: clip_grad_norm: the optimizer steps in backward (step_in_backward), so each gradient "
        "was applied before the global norm was known; turn off clipping or step_in_backward");
  }
  // Sum of squares per shard group: elements are distinct within a shard group and identical
  // across replicas, so each group is reduced once and replicas are not counted twice. Groups are
  // kept in unit order, which is the same on every rank, so the all-reduces are too; every rank
  // reduces every group, with or without gradients of its own.
  std::vector<std::pair<Communicator*, at::Tensor>> partial;
  std::vector<at::Tensor> grads;
  shards.collect_all();
  for (GradShard& shard : shards.all()) {
    if (!shard.trainable()) continue;
    Communicator* group = shard.norm_group();
    auto it = std::find_if(partial.begin(), partial.end(), [&](const auto& p) { return p.first == group; });
    if (it == partial.end()) {
      partial.emplace_back(group, at::Tensor());
      it = partial.end() - 1;
    }
    at::Tensor& g = shard.grad();  // collected above
    if (!g.defined()) continue;
    grads.push_back(g);
    // The partial sum lives where the group's first gradient does: on a device, no host sync
    // per flat param.
    if (!it->second.defined()) it->second = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(g.device()));
    if (g.device() == it->second.device()) {
      kernels::sum_of_squares(g, it->second);  // accumulates in double
    } else {
      auto sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(g.device()));
      kernels::sum_of_squares(g, sq);
      it->second.add_(sq.to(it->second.device()));
    }
  }
  double total_sq = 0;
  for (auto& [group, sq] : partial) {
    if (!sq.defined()) sq = at::zeros({1}, at::kDouble);  // no gradient here yet: still takes part
    if (group != nullptr) group->all_reduce(sq, ReduceOp::kSum, "clip_grad_norm").wait();
    total_sq += sq.item<double>();
  }
  const double norm = std::sqrt(total_sq);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    for (auto& g : grads) kernels::scale_(g, coef);
  }
  return norm;
}

}  // namespace fsdp
