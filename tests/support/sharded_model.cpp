#include "support/sharded_model.h"

#include <mutex>

namespace fsdp::testing {

ShardedModel make_sharded_model(DeviceMesh& mesh, const ShardedModelOptions& options) {
  Net net{nullptr};
  if (options.seed) {
    static std::mutex mu;  // rank threads share the global generator
    std::lock_guard<std::mutex> lock(mu);
    at::manual_seed(*options.seed);
    net = Net(options.net);
  } else {
    net = Net(options.net);
  }
  if (options.move_to) net->to(*options.move_to);
  return shard_model(std::move(net), mesh, options.shard, options.root_shard.value_or(options.shard), options.adamw);
}

}  // namespace fsdp::testing
