// See train_ranks.h.
#include "support/train_ranks.h"

#include <ATen/Parallel.h>

namespace fsdp::testing {

std::vector<std::string> train_ranks(int world, const std::function<std::string(DeviceMesh& mesh, int rank)>& rank_fn,
                                     std::chrono::milliseconds timeout) {
  std::vector<std::string> prints(world);
  run_threads(
      world,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        prints[dist->rank()] = rank_fn(mesh, dist->rank());
      },
      timeout);
  return prints;
}

}  // namespace fsdp::testing
