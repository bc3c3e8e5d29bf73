// Communication volume and memory of FULL_SHARD against the ZeRO-3 model: per step and rank,
// all-gather forward + all-gather backward + reduce-scatter = 3 * Psi * b * (N-1)/N bytes sent, and
// params + grads + AdamW state = 16 * Psi / N bytes (fp32), Psi counted with padding.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

void check_traffic_and_memory(int world) {
  testing::run_threads(world, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    testing::NetOptions o;
    o.in = 33, o.dim = 64, o.hidden = 95, o.out = 17, o.blocks = 4;
    testing::Net model(o);
    int64_t psi = 0;
    for (auto& p : model->parameters()) psi += p.numel();
    // Every unit, the root and the last block included, frees its params after forward, so every
    // unit is gathered twice per step (by default the root and the last block keep theirs).
    for (auto& b : model->blocks) fully_shard(b, mesh, FullyShardOptions().reshard_after_forward(true));
    auto root = fully_shard(model, mesh, FullyShardOptions().reshard_after_forward(true));
    AdamW optim(root, AdamWOptions(1e-3));

    int64_t padded = 0, largest_unit = 0, root_unit = 0;
    for (const auto& unit : fsdp::testing::units(*root)) {
      int64_t unit_bytes = 0;
      for (auto& fp : unit->flat_params()) {
        padded += fp->padded_numel();
        unit_bytes += fp->padded_numel() * 4;
      }
      if (unit->is_root()) root_unit = unit_bytes;
      else largest_unit = std::max(largest_unit, unit_bytes);
    }
    auto x = at::randn({4, o.in}), y = at::randn({4, o.out});
    auto& comm = dist->world();
    for (int step = 0; step < 2; ++step) {
      const auto before = comm.stats();
      at::mse_loss(fsdp::call(model, x), y).backward();
      optim.step();
      optim.zero_grad();
      const auto d = comm.stats() - before;
      const uint64_t ag = d.of(CollectiveKind::kAllGather).bytes_sent;
      const uint64_t rs = d.of(CollectiveKind::kReduceScatter).bytes_sent;
      const uint64_t expect = 4ull * padded * (world - 1) / world;
      EXPECT_EQ(ag, 2 * expect) << "step " << step;
      EXPECT_EQ(rs, expect) << "step " << step;
      const double zero3 = 3.0 * psi * 4 * (world - 1) / world;
      if (world > 1) EXPECT_NEAR(static_cast<double>(ag + rs) / zero3, 1.0, 0.05);
    }
    const auto report = memory_report(*root, &optim);
    EXPECT_EQ(report.model_state(), 16 * padded / world) << report.to_string();
    EXPECT_LE(report.model_state(), 16.0 * psi / world * 1.05 + 64) << report.to_string();
    EXPECT_EQ(report.unsharded_alive, 0) << report.to_string();
    // Gathered at once, at most: the root's params and gradients, one block's params and
    // gradients, the previous block's gradients while their reduce-scatter is in flight, and the
    // next block's params, prefetched (depth 1).
    if (world > 1) EXPECT_LE(report.peak_unsharded, 2 * root_unit + 4 * largest_unit) << report.to_string();
  });
}

TEST(Traffic, ZeroThreeVolumeAndMemoryAtWorld1) { check_traffic_and_memory(1); }
TEST(Traffic, ZeroThreeVolumeAndMemoryAtWorld2) { check_traffic_and_memory(2); }
TEST(Traffic, ZeroThreeVolumeAndMemoryAtWorld4) { check_traffic_and_memory(4); }

}  // namespace
}  // namespace fsdp
