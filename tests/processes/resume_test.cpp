// Resume equals uninterrupted: 2N straight steps versus N steps + save, then fresh processes that
// load and run N more. Per-step losses and final shards must be bitwise equal at the same world
// size. Negative controls show the comparison fails when the RNG state or the data position is
// not restored, so the test can tell.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"
#include "support/state.h"

namespace fsdp {
namespace {

constexpr int kWorld = 2, kHalf = 3;
constexpr int64_t kGlobalBatch = 8;

using Job = testing::ShardedModel;

Job build(DeviceMesh& mesh) {
  testing::ShardedModelOptions o;
  o.net.device = at::kMeta;
  o.shard.init(init::normal(0.2, 11));
  return testing::make_sharded_model(mesh, o);
}

// One step on the global samples [samples_seen, samples_seen + kGlobalBatch); inputs get noise
// from this process's default generator, so the RNG state matters.
double train_step(Job& j, int64_t& samples_seen, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + samples_seen);
  auto x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 5}, gen);
  const int64_t local = kGlobalBatch / kWorld;
  auto xs = x.narrow(0, rank * local, local) + 0.1 * at::randn({local, 7});
  const double loss = testing::train_on_batch(j, xs, y.narrow(0, rank * local, local));
  samples_seen += kGlobalBatch;
  return loss;
}

void child_body(int rank) {
  at::set_num_threads(1);
  const std::string mode = std::getenv("FSDP_RESUME_MODE");
  const std::string dir = std::getenv("FSDP_RESUME_DIR");
  auto dist = init_from_env(InitOptions().timeout(std::chrono::seconds(20)));
  DeviceMesh mesh(dist);
  at::manual_seed(1000 + rank);
  Job j = build(mesh);
  int64_t samples_seen = 0;
  int step = 0;
  std::vector<double> losses;
  if (mode == "first") {
    for (; step < kHalf; ++step) train_step(j, samples_seen, rank);
    checkpoint::TrainState st;
    st.step = step;
    st.samples_seen = samples_seen;
    checkpoint::save(io::join(dir, "ckpt"), "step-00000003", *j.root, j.optim.get(), st);
    return;
  }
  if (mode != "straight") {
    auto st = checkpoint::load(checkpoint::resolve(io::join(dir, "ckpt"), "latest"), *j.root, j.optim.get());
    step = static_cast<int>(st.step);
    samples_seen = st.samples_seen;
    if (mode == "resume-no-rng") at::manual_seed(5);
    if (mode == "resume-no-data") samples_seen = 0;
  } else {
    for (; step < kHalf; ++step) train_step(j, samples_seen, rank);
  }
  for (; step < 2 * kHalf; ++step) losses.push_back(train_step(j, samples_seen, rank));
  std::ofstream(io::join(dir, mode + "-" + std::to_string(rank)), std::ios::binary)
      << testing::state_bytes(losses, *j.root);
}

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Resume, EqualsUninterruptedTrainingBitwise) {
  const bool child = std::getenv("FSDP_TEST_CHILD") != nullptr;
  if (child) {
    testing::run_processes(kWorld, child_body);  // runs child_body and exits
    return;
  }
  const std::string dir = testing::temp_path("resume");
  io::make_dirs(dir);
  auto run = [&](const std::string& mode) {
    testing::ProcessOptions opts;
    opts.extra_env = {{"FSDP_RESUME_MODE", mode}, {"FSDP_RESUME_DIR", dir}};
    testing::expect_all_ok(testing::run_processes(kWorld, child_body, opts));
  };
  run("straight");
  run("first");
  run("resume");
  run("resume-no-rng");
  run("resume-no-data");
  for (int r = 0; r < kWorld; ++r) {
    const std::string straight = read(io::join(dir, "straight-" + std::to_string(r)));
    ASSERT_FALSE(straight.empty());
    EXPECT_EQ(read(io::join(dir, "resume-" + std::to_string(r))), straight) << "rank " << r;
    // Negative controls: without the RNG state or the data position the runs diverge.
    EXPECT_NE(read(io::join(dir, "resume-no-rng-" + std::to_string(r))), straight) << "rank " << r;
    EXPECT_NE(read(io::join(dir, "resume-no-data-" + std::to_string(r))), straight) << "rank " << r;
  }
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
