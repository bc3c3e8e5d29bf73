// Collectives over the thread tier: every op at world sizes 1-4, odd sizes, fp32 and bf16, against
// a reference computed locally; byte counters against the ring formulas; the 2-D mesh groups.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/communicator_impl.h"
#include "fsdp/device_mesh.h"
#include "fsdp/errors.h"
#include "fsdp/stop.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

using testing::run_threads;

// Deterministic per-rank input, the same on every rank for a given (rank, n, seed).
at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype, int seed = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * seed + rank + 1);
  return at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

double tolerance(at::ScalarType dtype, int world) { return dtype == at::kBFloat16 ? 0.02 * world : 1e-5; }

struct Case {
  int world;
  int64_t shard;  // elements per rank
  at::ScalarType dtype;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "world " << c.world << ", " << c.shard << " elements per rank, " << c.dtype;
}

class CollectiveSweep : public ::testing::TestWithParam<Case> {};

TEST_P(CollectiveSweep, AllGatherMatchesReference) {
  const auto c = GetParam();
  run_threads(c.world, [&](const std::shared_ptr<Dist>& dist) {
    auto& comm = dist->world();
    auto input = rank_input(dist->rank(), c.shard, c.dtype);
    auto output = at::full({c.shard * c.world}, -7.0, input.options());
    comm.all_gather(output, input, "ag").wait();
    std::vector<at::Tensor> parts;
    for (int r = 0; r < c.world; ++r) parts.push_back(rank_input(r, c.shard, c.dtype));
    EXPECT_TRUE(at::equal(output, at::cat(parts))) << "rank " << dist->rank();
    const auto s = comm.stats().of(CollectiveKind::kAllGather);
    const uint64_t shard_bytes = c.shard * input.element_size();
    EXPECT_EQ(s.calls, 1u);
    EXPECT_EQ(s.bytes_sent, shard_bytes * (c.world - 1));
    EXPECT_EQ(s.bytes_received, shard_bytes * (c.world - 1));
  });
}

TEST_P(CollectiveSweep, ReduceScatterMatchesReference) {
  const auto c = GetParam();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    run_threads(c.world, [&](const std::shared_ptr<Dist>& dist) {
      auto& comm = dist->world();
      auto input = rank_input(dist->rank(), c.shard * c.world, c.dtype, 1);
      auto output = at::empty({c.shard}, input.options());
      comm.reduce_scatter(output, input, op, "rs").wait();
      auto ref = at::zeros({c.shard * c.world}, at::kFloat);
      for (int r = 0; r < c.world; ++r) ref += rank_input(r, c.shard * c.world, c.dtype, 1).to(at::kFloat);
      if (op == ReduceOp::kAvg) ref /= c.world;
      auto mine = ref.narrow(0, dist->rank() * c.shard, c.shard);
      const double err = (output.to(at::kFloat) - mine).abs().max().item<double>();
      EXPECT_LE(err, tolerance(c.dtype, c.world)) << "rank " << dist->rank();
      const auto s = comm.stats().of(CollectiveKind::kReduceScatter);
      const uint64_t buffer_bytes = c.shard * c.world * output.element_size();
      // Bandwidth-optimal: exactly (N-1)/N of the buffer leaves each rank.
      EXPECT_EQ(s.bytes_sent, buffer_bytes / c.world * (c.world - 1));
      EXPECT_LE(s.bytes_sent * c.world, buffer_bytes * (c.world - 1));
    });
  }
}

TEST_P(CollectiveSweep, AllReduceAndBroadcastMatchReference) {
  const auto c = GetParam();
  run_threads(c.world, [&](const std::shared_ptr<Dist>& dist) {
    auto& comm = dist->world();
    auto t = rank_input(dist->rank(), c.shard, c.dtype, 2);
    comm.all_reduce(t, ReduceOp::kSum, "ar").wait();
    auto ref = at::zeros({c.shard}, at::kFloat);
    for (int r = 0; r < c.world; ++r) ref += rank_input(r, c.shard, c.dtype, 2).to(at::kFloat);
    EXPECT_LE((t.to(at::kFloat) - ref).abs().max().item<double>(), tolerance(c.dtype, c.world));

    const int root = c.world - 1;
    auto b = rank_input(dist->rank(), c.shard, c.dtype, 3);
    comm.broadcast(b, root, "bc").wait();
    EXPECT_TRUE(at::equal(b, rank_input(root, c.shard, c.dtype, 3)));
    comm.barrier("end");
  });
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "w" + std::to_string(info.param.world) + "_n" + std::to_string(info.param.shard) + "_" +
         (info.param.dtype == at::kBFloat16 ? "bf16" : "fp32");
}

INSTANTIATE_TEST_SUITE_P(Collectives, CollectiveSweep,
                         ::testing::Values(Case{1, 5, at::kFloat}, Case{2, 1, at::kFloat}, Case{2, 7, at::kFloat},
                                           Case{3, 13, at::kFloat}, Case{4, 15, at::kFloat},
                                           Case{3, 300001, at::kFloat}, Case{2, 9, at::kBFloat16},
                                           Case{3, 11, at::kBFloat16}, Case{4, 1023, at::kBFloat16}),
                         case_name);

TEST(Collectives, ManyOutstandingOpsCompleteInIssueOrder) {
  run_threads(3, [](const std::shared_ptr<Dist>& dist) {
    auto& comm = dist->world();
    std::vector<at::Tensor> outs;
    std::vector<CommHandle> handles;
    for (int i = 0; i < 20; ++i) {
      auto in = at::full({4}, dist->rank() * 100 + i, at::kFloat);
      outs.push_back(at::empty({12}, at::kFloat));
      handles.push_back(comm.all_gather(outs.back(), in, "op" + std::to_string(i)));
    }
    for (int i = 19; i >= 0; --i) handles[i].wait();  // waiting out of order is fine
    for (int i = 0; i < 20; ++i) {
      for (int r = 0; r < 3; ++r) EXPECT_EQ(outs[i][r * 4].item<float>(), r * 100 + i);
    }
    EXPECT_EQ(comm.stats().of(CollectiveKind::kAllGather).calls, 20u);
  });
}

TEST(Collectives, ShapeMismatchIsRejectedBeforeCommunicating) {
  run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    auto in = at::zeros({4});
    auto out = at::zeros({7});
    EXPECT_THROW(dist->world().all_gather(out, in, "bad"), ConfigError);
    EXPECT_THROW(dist->world().reduce_scatter(in, out, ReduceOp::kSum, "bad"), ConfigError);
    EXPECT_THROW(dist->world().broadcast(in, 5, "bad"), ConfigError);
  });
}

TEST(Collectives, LocalGroupIsOneRankOfLocalCopies) {
  auto group = make_local_group("solo", /*global_rank=*/3);
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->size(), 1);
  EXPECT_EQ(group->name(), "solo");
  EXPECT_EQ(group->global_rank(0), 3);
  auto in = at::arange(5, at::kFloat);
  auto out = at::empty({5}, at::kFloat);
  auto handle = group->all_gather(out, in, "copy");
  EXPECT_TRUE(handle.is_completed());  // one rank: run at once, on the caller's thread
  handle.wait();
  EXPECT_TRUE(at::equal(out, in));
  auto shard = at::empty({5}, at::kFloat);
  group->reduce_scatter(shard, in.clone(), ReduceOp::kAvg, "copy").wait();
  EXPECT_TRUE(at::equal(shard, in));
  EXPECT_EQ(group->stats().of(CollectiveKind::kAllGather).calls, 1u);
  EXPECT_EQ(group->stats().total_bytes_sent(), 0u);
}

TEST(Collectives, CommunicatorNeedsOneGlobalRankPerRank) {
  CommunicatorOptions options;
  options.name = "lopsided";
  options.global_ranks = {0, 1};
  EXPECT_THROW(make_communicator(make_local_transport(), options), ConfigError);
}

TEST(DeviceMesh, TwoDimensionalGroups) {
  run_threads(4, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist, /*replicate_size=*/2, /*shard_size=*/2);
    EXPECT_TRUE(mesh.is_hybrid());
    EXPECT_EQ(mesh.replicate_rank(), dist->rank() / 2);
    EXPECT_EQ(mesh.shard_rank(), dist->rank() % 2);
    // Shard groups are rows {0,1} and {2,3}.
    auto in = at::full({3}, dist->rank(), at::kFloat);
    auto out = at::empty({6}, at::kFloat);
    mesh.shard_group().all_gather(out, in, "row").wait();
    const int row = mesh.replicate_rank();
    EXPECT_EQ(out[0].item<float>(), row * 2);
    EXPECT_EQ(out[3].item<float>(), row * 2 + 1);
    // Replicate groups are columns {0,2} and {1,3}.
    auto t = at::full({2}, dist->rank(), at::kFloat);
    mesh.replicate_group().all_reduce(t, ReduceOp::kSum, "col").wait();
    EXPECT_EQ(t[0].item<float>(), mesh.shard_rank() * 2 + 2);
    EXPECT_EQ(mesh.replicate_group().global_rank(1), 2 + mesh.shard_rank());
  });
}

TEST(DeviceMesh, RejectsShapeThatDoesNotFitTheWorld) {
  run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    EXPECT_THROW(DeviceMesh(dist, 3, 1), ConfigError);
    DeviceMesh flat(dist);
    EXPECT_FALSE(flat.is_hybrid());
    EXPECT_EQ(flat.shard_size(), 2);
    EXPECT_EQ(flat.replicate_group().size(), 1);
  });
}

// The stop agreement: every rank gets the lowest rank's signal (0 when none has one), and
// agree_on_stop_with gathers each rank's values in the same collective.
TEST(StopAgreement, EveryRankGetsTheLowestRanksSignalAndEveryRanksValues) {
  run_threads(3, [](const std::shared_ptr<Dist>& dist) {
    const int r = dist->rank();
    EXPECT_EQ(agree_on_stop(dist->world(), 0), 0);
    EXPECT_EQ(agree_on_stop(dist->world(), r == 0 ? 0 : 10 + r), 11);
    const StopAgreement a = agree_on_stop_with(dist->world(), r == 2 ? 15 : 0, {1.5 * r, -double(r)});
    EXPECT_EQ(a.signal, 15);
    ASSERT_EQ(a.values.size(), 3u);
    for (int k = 0; k < 3; ++k) EXPECT_EQ(a.values[k], (std::vector<double>{1.5 * k, -double(k)})) << "rank " << k;
    const StopAgreement none = agree_on_stop_with(dist->world(), 0, {});
    EXPECT_EQ(none.signal, 0);
    EXPECT_EQ(none.values.size(), 3u);
  });
}

}  // namespace
}  // namespace fsdp
