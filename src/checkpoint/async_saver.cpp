// AsyncSaver: snapshot on the caller's thread, write on a background thread, one save in flight.
// The background save talks over its own communicator (Dist::side_group("checkpoint")), so its
// agreement collectives never interleave with training's collectives.
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "checkpoint/save_job.h"
#include "fsdp/checkpoint.h"

namespace fsdp::checkpoint {

struct AsyncSaver::Impl {
  std::thread worker;
  std::exception_ptr error;
  std::atomic<bool> running{false};
  int64_t snapshot_bytes = 0;
};

namespace {
int64_t bytes_of(const ShardData& d) {
  int64_t n = 0;
  for (const auto& t : d.params) n += t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  for (const auto& m : d.states) {
    for (const auto& [name, t] : m) n += t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  }
  return n;
}
}  // namespace

AsyncSaver::AsyncSaver() : impl_(std::make_unique<Impl>()) {}

AsyncSaver::~AsyncSaver() {
  try {
    wait();
  } catch (...) {
    // A destructor must not throw; the error was the caller's to collect with wait().
  }
}

void AsyncSaver::save(const std::string& root_dir, const std::string& name, FSDPModule& root,
                      ShardedOptimizer* optimizer, const TrainState& state, const SaveOptions& options) {
  wait();  // one save in flight: memory stays bounded by one snapshot
  auto job = std::make_shared<SaveJob>(make_save_job(root_dir, name, root, optimizer, state, options, /*copy=*/true));
  impl_->snapshot_bytes = bytes_of(job->data);
  impl_->running = true;
  impl_->worker = std::thread([this, job]() mutable {
    try {
      run_save(*job);
    } catch (...) {
      impl_->error = std::current_exception();
    }
    job.reset();  // the snapshot goes before the save counts as finished
    impl_->running = false;
  });
}

bool AsyncSaver::in_flight() const { return impl_->running; }

int64_t AsyncSaver::snapshot_bytes() const { return impl_->snapshot_bytes; }

void AsyncSaver::wait() {
  if (impl_->worker.joinable()) impl_->worker.join();
  if (impl_->error) {
    auto e = impl_->error;
    impl_->error = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace fsdp::checkpoint
