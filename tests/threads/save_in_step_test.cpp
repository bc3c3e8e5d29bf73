// checkpoint::SaveInStep (Note [A save fused into the step] in fsdp/checkpoint.h): the files it
// commits are byte for byte those of a save() made after the same step, whatever the step did
// (stepped every flat param, skipped, stepped twice, stepped in backward, created its state), and
// with the state in the disk tier nothing of the tier is read back to write them.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/fsdp.h"
#include "fsdp/offload.h"
#include "offload_job.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

using namespace offload_job;

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// What happens between making the SaveInStep and finishing it.
enum class Between { kStep, kSkippedStep, kTwoSteps };

struct Case {
  std::string name;
  std::optional<OffloadPolicy> offload;
  Between between = Between::kStep;
  int steps_before = 1;  // 0: the state is created by the observed step
  bool in_backward = false;
};

// Trains, then saves after the step under test twice: fused ("fused") and by save() ("plain");
// checks the tensor files are equal and, with a disk tier, that the fused save read nothing of
// it after the step.
void check_case(const Case& c, const std::string& dir) {
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, c.offload);
        const int rank = dist->rank();
        if (c.in_backward) j.optim->step_in_backward(true);
        auto step = [&](int64_t s) {
          if (c.in_backward) {
            testing::train_on_batch(j, at::randn({kGlobalBatch / kWorld, 7}), at::randn({kGlobalBatch / kWorld, 5}));
          } else {
            train_step(j, s, rank);
          }
        };
        for (int s = 0; s < c.steps_before; ++s) step(s);
        checkpoint::TrainState st;
        st.step = 5;
        checkpoint::SaveInStep fused(dir, "fused", *j.root, *j.optim);
        switch (c.between) {
          case Between::kStep: step(c.steps_before); break;
          case Between::kSkippedStep: {
            auto x = at::randn({kGlobalBatch / kWorld, 7}), y = at::randn({kGlobalBatch / kWorld, 5});
            at::mse_loss(fsdp::call(j.model, x), y).backward();
            j.optim->zero_grad();  // as a GradScaler skips a step
            break;
          }
          case Between::kTwoSteps:
            step(c.steps_before);
            step(c.steps_before + 1);
            break;
        }
        const int64_t in_step = fused.bytes_written_in_step();
        if (c.between == Between::kStep) {
          EXPECT_GT(in_step, 0) << "rank " << rank << ": nothing was written during the step";
        }
        if (c.between == Between::kSkippedStep) EXPECT_EQ(in_step, 0);
        const auto io0 = offload_io(*j.root);
        fused.finish(st);
        const auto read = (offload_io(*j.root) - io0).disk_read;
        if (c.offload && c.between == Between::kStep) {
          EXPECT_EQ(read, 0) << "rank " << rank << ": the fused save read the disk tier back";
        }
        checkpoint::save(dir, "plain", *j.root, j.optim.get(), st);
      },
      std::chrono::seconds(120));
  int compared = 0;
  for (const auto& name : io::list_dir(io::join(dir, "plain"))) {
    if (name.find(".safetensors") == std::string::npos) continue;
    const std::string plain = file_text(io::join(io::join(dir, "plain"), name));
    ASSERT_GT(plain.size(), name.find(".json") == std::string::npos ? 100000u : 100u) << name;
    EXPECT_TRUE(plain == file_text(io::join(io::join(dir, "fused"), name))) << c.name << ": " << name << " differs";
    ++compared;
  }
  EXPECT_EQ(compared, 6) << "model and two optimizer states, each a file and an index";
  EXPECT_EQ(checkpoint::read_train_state(io::join(dir, "fused")).step, 5);
}

TEST(SaveInStep, FilesEqualASaveAfterTheStep) {
  const std::string dir = testing::temp_path("save-in-step");
  const std::vector<Case> cases = {
      {"memory", std::nullopt},
      {"disk tier", disk_policy(io::join(dir, "tier-a"))},
      {"disk tier, budgetless, first step",
       OffloadPolicy().params(OffloadTier::kDisk).optimizer_state(OffloadTier::kDisk).dir(io::join(dir, "tier-b")),
       Between::kStep, 0},
      {"disk tier, step in backward", disk_policy(io::join(dir, "tier-c")), Between::kStep, 1, true},
      {"disk tier, skipped step", disk_policy(io::join(dir, "tier-d")), Between::kSkippedStep},
      {"disk tier, two steps", disk_policy(io::join(dir, "tier-e")), Between::kTwoSteps},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string ckpt = io::join(dir, "ckpt");
    io::remove_tree(ckpt);
    check_case(c, ckpt);
  }
  io::remove_tree(dir);
}

// Unfinished, it commits nothing and leaves the optimizer unobserved; finish twice is refused.
TEST(SaveInStep, DroppedUnfinishedCommitsNothing) {
  const std::string dir = testing::temp_path("save-in-step-dropped");
  testing::run_threads(
      kWorld,
      [&](const std::shared_ptr<Dist>& dist) {
        at::set_num_threads(1);
        DeviceMesh mesh(dist);
        Job j = build(mesh, disk_policy(io::join(dir, "tier")));
        train_step(j, 0, dist->rank());
        { checkpoint::SaveInStep dropped(dir, "dropped", *j.root, *j.optim); }
        train_step(j, 1, dist->rank());  // observed by nobody: the SaveInStep is gone
        checkpoint::SaveInStep twice(dir, "twice", *j.root, *j.optim);
        train_step(j, 2, dist->rank());
        twice.finish({});
        EXPECT_THROW(twice.finish({}), UsageError);
      },
      std::chrono::seconds(60));
  EXPECT_FALSE(io::exists(io::join(io::join(dir, "dropped"), "train_state.json")));
  EXPECT_TRUE(checkpoint::has_latest(dir));
  EXPECT_EQ(checkpoint::resolve(dir, "latest"), io::join(dir, "twice"));
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
