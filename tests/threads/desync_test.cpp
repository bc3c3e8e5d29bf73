// Collective identities (Note [Collective identity in the framing] in src/comm/ring.cpp, Note
// [Identity check in the queue] in src/comm/id_check.cpp): ranks that issue different collectives
// fail at the first one, on every rank, naming both sides, over shared memory and over Gloo, with
// nothing of the mismatched collective used; no transport error aborts the process, and a stalled
// peer is a TimeoutError.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>
#include <typeinfo>

#include "comm/communicator_impl.h"
#include "comm/shm_channel.h"
#include "comm/transport.h"
#include "fsdp/fsdp.h"
#include "support/ranks.h"
#include "support/sharded_model.h"

namespace fsdp {
namespace {
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Each rank's outcome: its error text and type ("" = none), and the seconds it took.
struct Outcome {
  std::vector<std::string> errors;
  std::vector<std::string> kinds;  // "DistError", "TimeoutError", "other", ""
  std::vector<double> seconds;
};

std::string kind_of(const std::exception& e) {
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr) return "TimeoutError";
  if (dynamic_cast<const DistError*>(&e) != nullptr) return "DistError";
  return std::string("other: ") + typeid(e).name();
}

// Ranks as threads over a FileStore, on the given CPU transport ("auto": shared memory; "gloo").
Outcome run_ranks(int world, const std::string& transport, std::chrono::milliseconds timeout,
                  const std::function<void(const std::shared_ptr<Dist>&)>& fn) {
  const std::string path = testing::temp_path("desync-store");
  Outcome out;
  out.errors.resize(world);
  out.kinds.resize(world);
  out.seconds.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::shared_ptr<Dist> dist;
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, world);
        dist = Dist::from_store(store, r, world, InitOptions().timeout(timeout).cpu_transport(transport));
        const auto t0 = Clock::now();
        try {
          fn(dist);
        } catch (const std::exception& e) {
          out.errors[r] = e.what();
          out.kinds[r] = kind_of(e);
        }
        out.seconds[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      } catch (const std::exception& e) {
        out.errors[r] = std::string("set-up failed: ") + e.what();
        out.kinds[r] = "set-up";
      }
    });
  }
  for (auto& t : threads) t.join();
  ::unlink(path.c_str());
  return out;
}

void expect_has(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "missing '" << needle << "' in: " << text;
}

// Six training steps in which rank 1 skips step 2's backward; `steps_done` gets each finished step.
void train_skipping_a_backward(const std::shared_ptr<Dist>& shared, int* steps_done) {
  DeviceMesh mesh(shared);
  testing::ShardedModelOptions o;
  o.seed = 3;
  auto m = testing::make_sharded_model(mesh, o);
  for (int s = 0; s < 6; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s);
    auto x = at::randn({4, o.net.in}, gen), y = at::randn({4, o.net.out}, gen);
    at::Tensor loss = at::mse_loss(fsdp::call(m.model, x), y);
    if (!(shared->rank() == 1 && s == 2)) loss.backward();
    m.optim->step();
    m.optim->zero_grad();
    if (steps_done != nullptr) *steps_done = s + 1;
  }
}

class Desync : public ::testing::TestWithParam<std::string> {};

// The case: an 80-byte reduce-scatter on rank 0 meets a 384-byte all-gather on rank 1.
// Both ranks fail at once (far within the 20 s timeout) naming both sides, and rank 0's output
// holds none of rank 1's bytes.
TEST_P(Desync, MismatchedCollectivesFailAtOnceOnEveryRankNamingBothSides) {
  at::Tensor rs_out = at::full({10}, -7.0, at::kFloat);
  auto out = run_ranks(2, GetParam(), 20s, [&](const std::shared_ptr<Dist>& shared) {
    Dist& dist = *shared;
    auto& g = dist.world();
    g.all_reduce(at::ones({8}), ReduceOp::kSum, "warm-up").wait();  // a matched one first
    if (dist.rank() == 0) {
      g.reduce_scatter(rs_out, at::ones({20}), ReduceOp::kSum, "layers.1").wait();
    } else {
      auto gathered = at::empty({2 * 48}, at::kDouble);
      g.all_gather(gathered, at::ones({48}, at::kDouble), "layers.2").wait();
    }
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(out.kinds[r], "DistError") << out.errors[r];
    EXPECT_LT(out.seconds[r], 5.0);
    expect_has(out.errors[r], "collective mismatch");
    expect_has(out.errors[r], "reduce_scatter 'layers.1' (80 bytes of Float) as collective #1");
    expect_has(out.errors[r], "all_gather 'layers.2' (384 bytes of Double) as collective #1");
    expect_has(out.errors[r], "this rank (rank " + std::to_string(r) + ")");
    expect_has(out.errors[r], "skipped or repeated a forward or backward");
  }
  EXPECT_TRUE(at::equal(rs_out, at::full({10}, -7.0, at::kFloat))) << "a mismatched collective wrote its output";
}

// Same op and size, another tag (another unit): still a mismatch, and the group stays broken.
TEST_P(Desync, SameSizeAnotherTagIsAMismatchAndBreaksTheGroup) {
  auto out = run_ranks(2, GetParam(), 20s, [&](const std::shared_ptr<Dist>& shared) {
    Dist& dist = *shared;
    auto& g = dist.world();
    auto t = at::ones({64});
    try {
      g.all_reduce(t, ReduceOp::kSum, dist.rank() == 0 ? "blocks.0" : "blocks.1").wait();
    } catch (const DistError& e) {
      EXPECT_TRUE(at::equal(t, at::ones({64}))) << "a mismatched all-reduce changed its tensor";
      // The next collective does not run on a group that paired the wrong bytes.
      try {
        g.all_reduce(at::ones({4}), ReduceOp::kSum, "after").wait();
        ADD_FAILURE() << "a collective ran after a mismatch";
      } catch (const DistError& again) {
        expect_has(again.what(), "unusable after an earlier failure");
      }
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out.kinds[r], "DistError") << out.errors[r];
    expect_has(out.errors[r], "all_reduce 'blocks.0' (256 bytes of Float)");
    expect_has(out.errors[r], "all_reduce 'blocks.1' (256 bytes of Float)");
  }
}

// Three ranks, rank 1 skips a collective: its neighbours name the mismatch, and every rank fails
// within the timeout (the far rank learns the reason through the closed channel or the identity
// sent backwards).
TEST_P(Desync, ASkippedCollectiveFailsEveryRankOfThree) {
  auto out = run_ranks(3, GetParam(), 10s, [&](const std::shared_ptr<Dist>& shared) {
    Dist& dist = *shared;
    auto& g = dist.world();
    if (dist.rank() != 1) g.all_gather(at::empty({3 * 5}), at::ones({5}), "embed").wait();
    g.all_gather(at::empty({3 * 7}), at::ones({7}), "head").wait();
    g.all_reduce(at::ones({3}), ReduceOp::kSum, "loss").wait();
  });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_FALSE(out.errors[r].empty());
    EXPECT_LT(out.seconds[r], 10.0 + 5);
    expect_has(out.errors[r], "collective mismatch");
  }
  expect_has(out.errors[0] + out.errors[1] + out.errors[2], "all_gather 'embed' (20 bytes of Float)");
  expect_has(out.errors[0] + out.errors[1] + out.errors[2], "all_gather 'head' (28 bytes of Float)");
}

// A peer that never arrives is a TimeoutError (not a plain DistError), naming the peer.
TEST_P(Desync, AStalledPeerIsATimeoutError) {
  auto out = run_ranks(2, GetParam(), 1500ms, [&](const std::shared_ptr<Dist>& shared) {
    Dist& dist = *shared;
    auto& g = dist.world();
    if (dist.rank() == 0) {
      g.all_reduce(at::ones({16}), ReduceOp::kSum, "grad norm").wait();
    } else {
      std::this_thread::sleep_for(4s);  // stalled past rank 0's timeout, then gone
    }
  });
  EXPECT_EQ(out.kinds[0], "TimeoutError") << out.errors[0];
  expect_has(out.errors[0], "all_reduce 'grad norm'");
  expect_has(out.errors[0], "rank 1");
  EXPECT_LT(out.seconds[0], 1.5 * 2 + 5 + 1);
}

// One rank skips a backward and goes on training: today's silent divergence. Every rank fails in
// that step, and no rank runs an optimizer step on a mixed-up gradient: the rank that skipped it
// at its optimizer step (no gradient reduced since zero_grad, Note [A step needs a gradient] in
// src/optim/optim.cpp), the other waiting on the reduction that rank never joined.
TEST_P(Desync, ARankThatSkipsABackwardStopsEveryRank) {
  std::vector<int> steps_done(2, 0);
  auto out = run_ranks(2, GetParam(), 20s, [&](const std::shared_ptr<Dist>& shared) {
    train_skipping_a_backward(shared, &steps_done[shared->rank()]);
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_FALSE(out.errors[r].empty()) << "rank " << r << " trained on";
    EXPECT_EQ(steps_done[r], 2);  // it never stepped on step 2's gradients
  }
  expect_has(out.errors[1], "step() with no gradient reduced since the last zero_grad()");
  expect_has(out.errors[0], "rank 1");
}

INSTANTIATE_TEST_SUITE_P(Transports, Desync, ::testing::Values("auto", "gloo"),
                         [](const auto& info) { return info.param == "auto" ? "SharedMemory" : "Gloo"; });

// A slot whose identity claims more bytes than any message, or another collective: an error, and
// nothing is read, allocated or copied from it.
TEST(DesyncFraming, AForgedSlotIsRefusedBeforeItsBytesAreUsed) {
  auto receiver = ShmChannel::create("forged", /*peer=*/1, /*self=*/0);
  auto sender = ShmChannel::open(receiver->name(), /*peer=*/0, /*self=*/1);
  receiver->unlink();
  CollectiveId id;
  id.seq = 4;
  id.kind = static_cast<int>(CollectiveKind::kAllGather);
  id.dtype = static_cast<int>(at::kFloat);
  id.bytes = 64;
  id.tag = "blocks.3";
  CollectiveId forged = id;
  forged.bytes = uint64_t{1} << 50;
  const auto deadline = Clock::now() + 2s;
  std::vector<float> data(16, 1.0f);
  sender->write(data.data(), 64, WireId::of(forged), deadline);
  bool consumed = false;
  try {
    receiver->read(
        64, WireId::of(id), [&](const void*) { consumed = true; }, deadline);
    ADD_FAILURE() << "a forged slot was read";
  } catch (const CollectiveMismatch& e) {
    expect_has(e.what(), "1125899906842624 bytes");
    expect_has(e.what(), "this rank (rank 0) runs all_gather 'blocks.3' (64 bytes of Float)");
  }
  EXPECT_FALSE(consumed);
  // A sender cannot put more than a slot into one.
  std::vector<char> huge(ShmChannel::kSlotBytes + 1);
  EXPECT_THROW(sender->write(huge.data(), huge.size(), WireId::of(id), deadline), DistError);
}

// A peer's identity whose tag length lies is described from the bytes that are there.
TEST(DesyncFraming, ALyingTagLengthIsDescribedSafely) {
  CollectiveId id;
  id.tag = std::string(200, 'x');
  WireId w = WireId::of(id);
  EXPECT_EQ(w.tag_len, 200u);
  w.tag_len = 0xffffffffu;
  const std::string text = w.describe();
  expect_has(text, std::string(88, 'x') + "...");
  EXPECT_FALSE(w.same_collective(WireId::of(id)));
}

// The closing side's reason reaches the peer: a rank further round the ring says why.
TEST(DesyncFraming, ClosedChannelCarriesTheReason) {
  auto receiver = ShmChannel::create("reason", 1, 0);
  auto sender = ShmChannel::open(receiver->name(), 0, 1);
  receiver->unlink();
  sender->close("rank 1 failed: collective mismatch: ...");
  try {
    receiver->read(
        4, WireId{}, [](const void*) {}, Clock::now() + 2s);
    ADD_FAILURE() << "read a closed channel";
  } catch (const PeerError& e) {
    expect_has(e.what(), "the channel was closed");
    expect_has(e.what(), "rank 1 failed: collective mismatch");
  }
}

// Note [Identity check in the queue]: the path NCCL takes, run on CPU with FSDP_COLLECTIVE_IDS=queue
// (the ring then carries no identity). A same-size mismatch is found at verify_collectives (what
// the end of backward calls), and by the periodic check every id_check_every collectives.
class QueueCheck : public ::testing::Test {
 protected:
  void SetUp() override { ::setenv("FSDP_COLLECTIVE_IDS", "queue", 1); }
  void TearDown() override { ::unsetenv("FSDP_COLLECTIVE_IDS"); }
};

TEST_F(QueueCheck, VerifyFindsASameSizeMismatchOnEveryRank) {
  auto out = run_ranks(2, "auto", 10s, [&](const std::shared_ptr<Dist>& shared) {
    Dist& dist = *shared;
    auto& g = dist.world();
    g.all_reduce(at::ones({4}), ReduceOp::kSum, "ok").wait();
    g.all_reduce(at::ones({4}), ReduceOp::kSum, dist.rank() == 0 ? "blocks.0" : "blocks.1").wait();
    g.verify_collectives("end of backward");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out.kinds[r], "DistError") << out.errors[r];
    expect_has(out.errors[r], "found by the identity check in the queue");
    expect_has(out.errors[r], "rank 0 ran all_reduce 'blocks.0' (16 bytes of Float) as collective #1");
    expect_has(out.errors[r], "rank 1 ran all_reduce 'blocks.1' (16 bytes of Float) as collective #1");
  }
}

TEST_F(QueueCheck, HealthyRunPassesAndTheWindowRunsByItself) {
  const std::string path = testing::temp_path("queue-store");
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
        CpuTransportOptions topts;
        topts.timeout = 10s;
        CommunicatorOptions copts;
        copts.timeout = 10s;
        copts.id_check_every = 3;
        auto g = make_communicator(make_cpu_transport(store, r, 2, topts), copts);
        for (int i = 0; i < 5; ++i) {
          auto t = at::ones({4});
          g->all_reduce(t, ReduceOp::kSum, "step").wait();
          EXPECT_EQ(t[0].item<float>(), 2.0f);
        }
        g->verify_collectives("healthy");
        // Collectives #5 and #6 differ; the check before #8 (every 3) finds them unasked.
        g->all_reduce(at::ones({4}), ReduceOp::kSum, r == 0 ? "a" : "b").wait();
        g->all_reduce(at::ones({4}), ReduceOp::kSum, "c").wait();
        g->all_reduce(at::ones({4}), ReduceOp::kSum, "d").wait();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  ::unlink(path.c_str());
  for (int r = 0; r < 2; ++r) {
    expect_has(errors[r], "all_reduce 'd'");  // the collective the check ran before
    expect_has(errors[r], "rank 0 ran all_reduce 'a' (16 bytes of Float) as collective #5");
    expect_has(errors[r], "rank 1 ran all_reduce 'b' (16 bytes of Float) as collective #5");
  }
}

// A training run whose rank skips a backward, with identities checked in the queue: the end of the
// next backward (verify_collectives) or the shared-memory slot sizes stop every rank.
TEST_F(QueueCheck, ARankThatSkipsABackwardStopsEveryRank) {
  auto out = run_ranks(2, "auto", 20s,
                       [&](const std::shared_ptr<Dist>& shared) { train_skipping_a_backward(shared, nullptr); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(out.errors[r].empty()) << "rank " << r << " trained on";
    EXPECT_NE(out.kinds[r], "") << out.errors[r];
  }
}

}  // namespace
}  // namespace fsdp
