// AsyncSaver: snapshot on the caller's thread, write on a background thread, one save in flight.
// The background save talks over its own communicator (Dist::side_group("checkpoint")), so its
// agreement collectives never interleave with training's collectives.
#include <exception>

#include "base/worker_queue.h"
#include "checkpoint/save_job.h"
#include "fsdp/checkpoint.h"

namespace fsdp::checkpoint {

struct AsyncSaver::Impl {
  // The saver's thread, started by the first save. A job's snapshot is released before the save
  // counts as finished; its error waits for wait().
  base::WorkerQueue<std::shared_ptr<SaveJob>> queue{
      [](std::shared_ptr<SaveJob>& job, const base::Turn&) { run_save(*job); }};
  int64_t snapshot_bytes = 0;
};

namespace {
int64_t bytes_of(const ShardData& d) {
  int64_t n = 0;
  for (const auto& t : d.params) n += t.defined() ? t.numel() * static_cast<int64_t>(t.values().element_size()) : 0;
  for (const auto& m : d.states) {
    for (const auto& [name, t] : m) n += t.defined() ? t.numel() * static_cast<int64_t>(t.values().element_size()) : 0;
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
  impl_->queue.submit(std::move(job));
}

bool AsyncSaver::in_flight() const { return impl_->queue.busy(); }

int64_t AsyncSaver::snapshot_bytes() const { return impl_->snapshot_bytes; }

void AsyncSaver::wait() {
  impl_->queue.wait_idle();
  if (std::exception_ptr e = impl_->queue.take_error()) std::rethrow_exception(e);
}

}  // namespace fsdp::checkpoint
