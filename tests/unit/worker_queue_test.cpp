// base::WorkerQueue, the primitive under every worker thread of the library: submission order,
// the first error and the two policies after it, stop with pending jobs (drained or dropped),
// waiting until idle, joining, lanes and the owner's state under the queue's lock.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "base/worker_queue.h"

namespace fsdp::base {
namespace {
using namespace std::chrono_literals;

// A job that records its number when run; its token shows when it is destroyed.
struct Job {
  int n = 0;
  std::shared_ptr<int> token = std::make_shared<int>(0);
};

// Job 0 holds its lane's thread: it says it has started, then waits until the gate opens (once).
struct Gate {
  std::promise<void> opening, starting;
  std::shared_future<void> opened = opening.get_future().share();
  std::shared_future<void> started = starting.get_future().share();
  void open() { opening.set_value(); }
  void hold(const Job& j) {
    if (j.n != 0) return;
    starting.set_value();
    opened.wait();
  }
};

TEST(WorkerQueue, RunsJobsInSubmissionOrderOnItsThread) {
  std::vector<int> ran;
  std::vector<std::thread::id> threads;
  WorkerQueue<Job> q([&](Job& j, const Turn& turn) {
    EXPECT_EQ(turn.lane, 0);
    EXPECT_FALSE(turn.first_error);
    EXPECT_FALSE(turn.stopping);
    ran.push_back(j.n);
    threads.push_back(std::this_thread::get_id());
  });
  for (int i = 0; i < 100; ++i) q.submit(Job{i});
  q.wait_idle();
  ASSERT_EQ(ran.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(ran[i], i);
  for (const auto& id : threads) {
    EXPECT_NE(id, std::this_thread::get_id());
    EXPECT_EQ(id, threads.front());
  }
  EXPECT_FALSE(q.busy());
  EXPECT_FALSE(q.error());
}

TEST(WorkerQueue, KeepsTheFirstErrorAndLaterJobsSeeIt) {
  std::vector<std::string> seen;  // per job: the first error it was told of
  WorkerQueue<Job> q([&](Job& j, const Turn& turn) {
    seen.push_back(error_text(turn.first_error));
    if (j.n == 2) throw std::runtime_error("job two failed");
    if (j.n == 4) throw std::runtime_error("job four failed");
  });  // AfterError::kRun: every job still runs
  for (int i = 0; i < 6; ++i) q.submit(Job{i});
  q.wait_idle();
  EXPECT_EQ(seen, (std::vector<std::string>{"", "", "", "job two failed", "job two failed", "job two failed"}));
  EXPECT_EQ(error_text(q.error()), "job two failed");  // kept: error() does not clear it
  EXPECT_EQ(error_text(q.take_error()), "job two failed");
  EXPECT_FALSE(q.error());
  q.submit(Job{7});
  q.wait_idle();
  EXPECT_EQ(seen.back(), "");  // taken: the next job is told of no error
}

TEST(WorkerQueue, KeepErrorWithoutThrowingKeepsOnlyTheFirst) {
  WorkerQueue<Job> q([&](Job&, const Turn&) {});
  q.keep_error(std::make_exception_ptr(std::logic_error("first")));
  q.keep_error(std::make_exception_ptr(std::logic_error("second")));
  EXPECT_EQ(error_text(q.take_error()), "first");
  EXPECT_EQ(error_text(nullptr), "");
  EXPECT_EQ(error_text(std::make_exception_ptr(42)), "an exception that is not a std::exception");
}

TEST(WorkerQueue, DropPolicyDestroysJobsUnrunUntilTheErrorIsTaken) {
  std::vector<int> ran;
  WorkerQueue<Job> q(
      [&](Job& j, const Turn&) {
        ran.push_back(j.n);
        if (j.n == 1) throw std::runtime_error("step failed");
      },
      AfterError::kDrop);
  std::vector<std::weak_ptr<int>> tokens;
  for (int i = 0; i < 5; ++i) {
    Job j{i};
    tokens.push_back(j.token);
    q.submit(std::move(j));
  }
  q.wait_idle();
  EXPECT_EQ(ran, (std::vector<int>{0, 1}));
  for (const auto& t : tokens) EXPECT_TRUE(t.expired());  // dropped jobs are destroyed too
  EXPECT_EQ(error_text(q.take_error()), "step failed");
  q.submit(Job{5});
  q.wait_idle();
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 5}));
}

TEST(WorkerQueue, StopDrainRunsThePendingJobsThenJoins) {
  Gate gate;
  std::vector<std::pair<int, bool>> ran;  // job, whether it was told the queue is stopping
  WorkerQueue<Job> q([&](Job& j, const Turn& turn) {
    gate.hold(j);
    ran.emplace_back(j.n, turn.stopping);
  });
  for (int i = 0; i < 4; ++i) q.submit(Job{i});
  gate.started.wait();  // job 0 is running, 1..3 are queued
  std::thread stopper([&] { q.stop(OnStop::kDrain); });
  while (!q.stopping()) std::this_thread::sleep_for(1ms);
  gate.open();
  stopper.join();  // stop() returned: the thread is joined
  EXPECT_EQ(ran, (std::vector<std::pair<int, bool>>{{0, false}, {1, true}, {2, true}, {3, true}}));
  EXPECT_FALSE(q.busy());
  q.stop(OnStop::kDrain);  // again: a no-op
  q.submit(Job{9});        // after stop: never runs
  EXPECT_EQ(ran.size(), 4u);
}

TEST(WorkerQueue, StopDropDestroysThePendingJobsUnrun) {
  Gate gate;
  std::vector<int> ran;
  WorkerQueue<Job> q([&](Job& j, const Turn&) {
    gate.hold(j);
    ran.push_back(j.n);
  });
  std::vector<std::weak_ptr<int>> tokens;
  for (int i = 0; i < 4; ++i) {
    Job j{i};
    tokens.push_back(j.token);
    q.submit(std::move(j));
  }
  gate.started.wait();  // job 0 is running, 1..3 are queued
  std::thread stopper([&] { q.stop(OnStop::kDrop); });
  while (!q.stopping()) std::this_thread::sleep_for(1ms);
  gate.open();
  stopper.join();
  EXPECT_EQ(ran, (std::vector<int>{0}));
  for (const auto& t : tokens) EXPECT_TRUE(t.expired());
}

TEST(WorkerQueue, WaitIdleReturnsOnceTheJobIsDestroyed) {
  WorkerQueue<std::shared_ptr<int>> q([](std::shared_ptr<int>&, const Turn&) { std::this_thread::sleep_for(20ms); });
  auto held = std::make_shared<int>(1);
  std::weak_ptr<int> weak = held;
  q.submit(std::move(held));
  EXPECT_TRUE(q.busy());
  q.wait_idle();
  EXPECT_TRUE(weak.expired());
  EXPECT_FALSE(q.busy());
}

TEST(WorkerQueue, DestructorRunsWhatIsQueuedAndJoins) {
  std::atomic<int> ran{0};
  {
    WorkerQueue<Job> q([&](Job&, const Turn&) {
      std::this_thread::sleep_for(1ms);
      ++ran;
    });
    for (int i = 0; i < 10; ++i) q.submit(Job{i});
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST(WorkerQueue, LanesRunSideBySideAndShareTheFirstError) {
  Gate lane1_ran;
  std::vector<int> taken;  // written under the lock by the take hook
  WorkerQueue<Job> q(
      [&](Job& j, const Turn& turn) {
        if (turn.lane == 0) {
          // Lane 0 waits for lane 1: it would never finish if the lanes shared a thread.
          ASSERT_EQ(lane1_ran.opened.wait_for(10s), std::future_status::ready);
          throw std::runtime_error("read failed");
        }
        lane1_ran.open();
        EXPECT_EQ(j.n, 1);
      },
      AfterError::kRun, /*lanes=*/2,
      [&](Job& j, int lane, std::unique_lock<std::mutex>& lock) {
        EXPECT_TRUE(lock.owns_lock());
        EXPECT_EQ(j.n, lane);
        taken.push_back(j.n);
      });
  q.submit(Job{0}, 0);
  q.submit(Job{1}, 1);
  q.wait_idle();
  EXPECT_EQ(taken.size(), 2u);
  EXPECT_EQ(error_text(q.error()), "read failed");
}

TEST(WorkerQueue, OwnerStateUnderTheLockIsWaitedForAfterEachJob) {
  int done = 0;  // the owner's, under the queue's lock
  WorkerQueue<Job>* self = nullptr;
  WorkerQueue<Job> q([&](Job&, const Turn&) {
    std::this_thread::sleep_for(5ms);
    auto lock = self->lock();
    ++done;
  });
  self = &q;
  for (int i = 0; i < 3; ++i) q.submit(Job{i});
  auto lock = q.lock();
  q.wait(lock, [&] { return done == 3; });  // woken by the queue after each job
  EXPECT_EQ(done, 3);
  lock.unlock();
  q.wait_idle();
}

TEST(WorkerQueue, BoundedSubmitWaitsForRoom) {
  Gate gate;
  std::vector<int> ran;
  WorkerQueue<Job> q([&](Job& j, const Turn&) {
    gate.hold(j);
    ran.push_back(j.n);
  });
  q.submit(Job{0});
  gate.started.wait();          // job 0 is running, nothing waits
  q.submit_bounded(Job{1}, 1);  // room for one
  auto third = std::async(std::launch::async, [&] { q.submit_bounded(Job{2}, 1); });
  EXPECT_EQ(third.wait_for(50ms), std::future_status::timeout);  // full: job 1 waits
  gate.open();                                                   // job 0 ends, the thread takes job 1: room again
  third.get();
  q.wait_idle();
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2}));
}

}  // namespace
}  // namespace fsdp::base
