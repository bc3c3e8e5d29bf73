// ShardedOptimizer::step_in_backward: the backward hands each flat param over to the optimizer's
// own thread as soon as its reduced gradient is collected (Note [The step in backward] in
// sharded_unit.cpp), through a post-reduce hook (shard/post_reduce_hook.h); step() steps what is
// left and waits for the rest.
//
// Note [Step in backward threads]
// The training thread (the autograd engine's, which runs the gradient hooks) does everything
// that touches the flat param: it collects the gradient (a host copy through pinned staging when
// the master follows an offloaded state), creates the state on first use, counts the step, takes
// the master a backward gather kept, issues the disk reads of the job's first chunk when the
// budget has room (so the disk reads on while the jobs ahead of it step), and queues the job.
// The optimizer's thread only runs the job (the optimizer's step_shard over the master and state,
// streamed through the disk tier's I/O threads, and the working copy's refresh), touching nothing
// the training thread uses until step() or zero_grad() waits for it. At most kMaxQueued jobs wait, so a slow disk holds
// back the backward instead of piling up kept masters and gradient copies. Every job is the same arithmetic on the same
// values as step() after backward, so the result is bitwise the same.
#include <c10/core/GradMode.h>

#include <exception>
#include <unordered_map>

#include "base/worker_queue.h"
#include "fsdp/errors.h"
#include "fsdp/optim.h"
#include "fsdp/trace.h"
#include "offload/tier_tensors.h"
#include "optim/optimizer_impl.h"
#include "optim/streamed_step.h"
#include "shard/grad_shards.h"
#include "shard/post_reduce_hook.h"

namespace fsdp {
namespace {
constexpr size_t kMaxQueued = 4;
}

struct ShardedOptimizer::Impl::InBackward : PostReduceHook {
  struct Entry {
    offload::StepJob job;
    Tracer* tracer = nullptr;
  };
  explicit InBackward(Impl& o) : owner(o) {}
  void gradient_reduced(GradShard& shard) override { owner.hand_over(shard); }

  Impl& owner;
  std::unordered_map<const void*, size_t> index;  // GradShard::key() -> its place in states
  std::vector<char> stepped;                      // per state: handed over since the last step()
  bool reserved = false;                          // offloaded state reserved this step

  // The optimizer's thread: after the first job that fails the later ones are dropped unrun, and
  // the error waits for step() (take_error). Stopping runs what is queued.
  base::WorkerQueue<Entry> queue{[](Entry& e, const base::Turn&) { run(e); }, base::AfterError::kDrop};

  static void run(Entry& e) {
    c10::NoGradGuard no_grad;
    Tracer::Scope span(e.tracer, "fsdp::step_in_backward", "optimizer", e.job.state->tag);
    std::vector<offload::StepJob> one;
    one.push_back(std::move(e.job));
    // Its writes stay queued (step() flushes them) and the reads issued for later gathers stay
    // valid: they are of flat params this job does not touch.
    offload::run_step(one, e.tracer, {/*flush=*/false, /*bump_generation=*/false});
  }
};

void ShardedOptimizer::step_in_backward(bool on) {
  if (on == (impl_->in_backward != nullptr)) return;
  if (!on) {
    impl_->stop_step_in_backward();
    return;
  }
  if (!can_step_in_backward()) {
    throw ConfigError("fsdp: " + type_name() +
                      " steps every shard at once, so it cannot step in backward (step_in_backward); use "
                      "fsdp::AdamW or fsdp::SGD, or step after backward");
  }
  impl_->start_step_in_backward();
}

void ShardedOptimizer::Impl::start_step_in_backward() {
  auto ib = std::make_shared<InBackward>(*this);
  if (read_ahead && shards.in_backward()) {
    throw UsageError("fsdp: step_in_backward turned on during a backward; turn it on before the backward");
  }
  remove_read_ahead();            // the step in backward reads for itself
  shards.install_hook(ib.get());  // refuses a second optimizer, or a backward under way
  for (size_t i = 0; i < states.size(); ++i) ib->index[shard_of(states[i]).key()] = i;
  ib->stepped.assign(states.size(), 0);
  ib->queue.start();
  in_backward = std::move(ib);
}

void ShardedOptimizer::Impl::stop_step_in_backward() {
  InBackward& ib = *in_backward;
  ib.queue.wait_idle();
  for (char s : ib.stepped) {
    if (s) throw UsageError("fsdp: step_in_backward turned off between a backward and its step(); call step() first");
  }
  ib.queue.stop(base::OnStop::kDrain);
  shards.remove_hook(&ib);
  in_backward.reset();
}

// Note [The optimizer's thread stops before its subclass goes]
// A queued step runs the subclass's step_shard: one left when ~ShardedOptimizer stopped the thread
// (no step() after a backward) aborted on a pure virtual call. AdamW and SGD stop it first.
void ShardedOptimizer::stop_steps_in_backward() {
  Impl& m = *impl_;
  if (!m.in_backward) return;
  m.in_backward->queue.stop(base::OnStop::kDrain);
  m.shards.remove_hook(m.in_backward.get());
  m.in_backward.reset();
}

ShardedOptimizer::~ShardedOptimizer() {
  impl_->remove_read_ahead();
  stop_steps_in_backward();  // AdamW and SGD have done it already
}

// On the training thread, from the backward's gradient hook: see Note [Step in backward threads].
void ShardedOptimizer::Impl::hand_over(GradShard& shard) {
  InBackward& ib = *in_backward;
  auto it = ib.index.find(shard.key());
  if (it == ib.index.end()) return;  // frozen: no optimizer state
  const size_t i = it->second;
  ShardState& s = states[i];
  if (ib.stepped[i]) {
    throw UsageError("fsdp: " + self.type_name() + " steps in backward (step_in_backward), and the gradient of " +
                     s.tag +
                     " was reduced again before step(): call step() after every backward that reduces gradients, "
                     "and accumulate micro-batches with set_requires_gradient_sync(false) on all but the last");
  }
  if (ib.queue.error()) return;  // step() reports it; nothing more steps
  c10::NoGradGuard no_grad;
  at::Tensor grad = shard.grad_for_step();
  if (!grad.defined()) return;
  if (!ib.reserved) {
    reserve_offloaded_state();  // Note [Offloaded state is reserved before the first update]
    ib.reserved = true;
  }
  if (s.tensors.empty()) self.init_state(s);
  ++s.step;
  InBackward::Entry e;
  e.job = make_job(s);
  e.job.prepare = [grad] { return grad; };
  e.tracer = shards.tracer();
  offload::prefetch_first_chunk(e.job);  // the disk reads on while the jobs ahead of it step
  ib.stepped[i] = 1;
  ib.queue.submit_bounded(std::move(e), kMaxQueued);
}

void ShardedOptimizer::Impl::wait_for_backward_steps() {
  Tracer::Scope span(shards.tracer(), "fsdp::step_in_backward_wait", "compute", "<all>");
  in_backward->queue.wait_idle();
}

// step() with step_in_backward on: what the backward handed over is stepped or being stepped;
// the rest (the flat params whose reductions the backward left to be collected, i.e. the last
// units of backward) steps now, then the tier's writes are waited for.
void ShardedOptimizer::Impl::finish_step_in_backward(Tracer* tracer) {
  InBackward& ib = *in_backward;
  wait_for_backward_steps();
  self.check_gradients_for_step();  // Note [A step needs a gradient]
  std::vector<char> stepped(states.size(), 0);
  std::swap(stepped, ib.stepped);
  const bool reserved = ib.reserved;
  ib.reserved = false;
  if (std::exception_ptr error = ib.queue.take_error()) std::rethrow_exception(error);
  if (!reserved) reserve_offloaded_state();
  std::vector<offload::StepJob> jobs;
  for (size_t i = states.size(); i-- > 0;) {
    if (!stepped[i]) jobs.push_back(make_job(states[i]));
  }
  offload::run_step(jobs, tracer);
  // The handed-over jobs' writes, and their masters changed: reads issued before are stale.
  if (offload::DiskTier* tier = shards.disk_tier()) {
    tier->flush();
    tier->bump_generation();
  }
}

}  // namespace fsdp
