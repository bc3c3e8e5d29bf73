// WorkerQueue: jobs run in submission order on a worker thread the queue owns, with the first
// error kept for the owner. The library's worker threads are all made of it (docs/ARCHITECTURE.md,
// "Threads"): the communicator's ordered queue, the disk tier's reader and writer, the optimizer's
// thread for the step in backward, the AsyncSaver's and a checkpoint file writer's.
//
// Note [Worker queues]
// A queue has one or more lanes; each lane is a FIFO with its own thread, and all lanes share one
// mutex, one condition variable and one first error (the disk tier's reads and writes are two
// lanes of one queue). The runner, given at construction, runs each job with the lock released;
// an exception it throws becomes the queue's first error if there is none yet (keep_error() does
// the same without throwing, for runners that report errors their own way). What happens to the
// jobs after a failure is the owner's policy:
//   AfterError::kRun   every job still reaches the runner, which sees the first error in its Turn
//                      (the communicator fails each later collective with it);
//   AfterError::kDrop  jobs are destroyed unrun while an error is kept, until take_error() (the
//                      step in backward drops the steps after a failed one; step() rethrows).
// stop() ends the threads: kDrain runs (or, under kDrop, drops) what is queued first, and the runner
// sees Turn::stopping; kDrop destroys what is queued. A job is destroyed on its lane's thread before
// the job counts as finished, so wait_idle() returning means every job's resources are released.
// Per job the queue takes its lock once to submit and once on the thread (the same acquisition
// that pops the next job), and allocates only what the std::deque does.
//
// The owner may keep state of its own under the queue's lock (lock(), wait(), notify()): state
// that its threads and its callers share, waited for on the same condition variable, which the
// queue notifies after every job.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fsdp::base {

enum class AfterError { kRun, kDrop };
enum class OnStop { kDrain, kDrop };

// What a runner is told with each job.
struct Turn {
  int lane = 0;
  std::exception_ptr first_error;  // the queue's first error when the job was taken, or null
  bool stopping = false;           // stop() was called
};

// e's what(), or a fixed text for an exception that is not a std::exception; "" for null.
std::string error_text(const std::exception_ptr& e);

template <class Job>
class WorkerQueue {
 public:
  using Runner = std::function<void(Job&, const Turn&)>;
  // Called with the lock held after a job is taken and before it runs (not for dropped jobs); it
  // may wait on the lock (e.g. for other lanes' work), and the job counts as running meanwhile.
  using OnTake = std::function<void(Job&, int lane, std::unique_lock<std::mutex>&)>;

  explicit WorkerQueue(Runner run, AfterError after = AfterError::kRun, int lanes = 1, OnTake on_take = nullptr)
      : run_(std::move(run)), on_take_(std::move(on_take)), after_(after), queues_(static_cast<size_t>(lanes)) {}
  WorkerQueue(const WorkerQueue&) = delete;
  WorkerQueue& operator=(const WorkerQueue&) = delete;
  ~WorkerQueue() { stop(OnStop::kDrain); }

  // Starts the lanes' threads unless started (submit starts them too).
  void start() {
    std::lock_guard<std::mutex> lock(mu_);
    start_locked();
  }
  // Queues `job` on `lane`. The _locked forms are for a caller holding lock().
  void submit(Job job, int lane = 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      submit_locked(std::move(job), lane);
    }
    cv_.notify_all();
  }
  void submit_locked(Job job, int lane = 0) {
    start_locked();
    queues_[static_cast<size_t>(lane)].push_back(std::move(job));
  }
  // Waits until fewer than `max_queued` jobs wait on `lane` (or an error is kept), then queues it.
  void submit_bounded(Job job, size_t max_queued, int lane = 0) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto& q = queues_[static_cast<size_t>(lane)];
      cv_.wait(lock, [&] { return q.size() < max_queued || error_; });
      submit_locked(std::move(job), lane);
    }
    cv_.notify_all();
  }

  // Until no job is queued or running on any lane.
  void wait_idle() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return idle_locked(); });
  }
  bool busy() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !idle_locked();
  }
  bool stopping() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  }

  // The first error: kept (error), or handed over and cleared (take_error).
  std::exception_ptr error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  std::exception_ptr take_error() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(error_, nullptr);
  }
  std::exception_ptr error_locked() const { return error_; }
  void keep_error(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    keep_error_locked(std::move(e));
  }
  void keep_error_locked(std::exception_ptr e) {
    if (!error_) error_ = std::move(e);
  }

  // Ends the threads (see Note [Worker queues]) and joins them. Idempotent.
  void stop(OnStop how) {
    std::vector<std::deque<Job>> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      if (how == OnStop::kDrop) {
        dropped.resize(queues_.size());
        for (size_t i = 0; i < queues_.size(); ++i) dropped[i].swap(queues_[i]);
      }
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  // The owner's state under the queue's lock: see Note [Worker queues].
  std::unique_lock<std::mutex> lock() const { return std::unique_lock<std::mutex>(mu_); }
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred pred) const {
    cv_.wait(lock, std::move(pred));
  }
  void notify() const { cv_.notify_all(); }

 private:
  bool idle_locked() const {
    if (running_ > 0) return false;
    for (const auto& q : queues_) {
      if (!q.empty()) return false;
    }
    return true;
  }

  void start_locked() {
    if (started_ || stopping_) return;
    started_ = true;
    for (size_t i = 0; i < queues_.size(); ++i) threads_.emplace_back([this, i] { loop(static_cast<int>(i)); });
  }

  void loop(int lane) {
    auto& q = queues_[static_cast<size_t>(lane)];
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !q.empty(); });
      if (q.empty()) return;
      ++running_;
      {
        Job job = std::move(q.front());
        q.pop_front();
        const Turn turn{lane, error_, stopping_};
        const bool run = !(after_ == AfterError::kDrop && error_);
        if (run && on_take_) on_take_(job, lane, lock);
        lock.unlock();
        if (run) {
          try {
            run_(job, turn);
          } catch (...) {
            keep_error(std::current_exception());
          }
        }
      }  // the job is destroyed here, unlocked, before it counts as finished
      lock.lock();
      --running_;
      cv_.notify_all();
    }
  }

  Runner run_;
  OnTake on_take_;
  AfterError after_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<std::deque<Job>> queues_;
  std::vector<std::thread> threads_;
  int running_ = 0;
  bool started_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace fsdp::base
