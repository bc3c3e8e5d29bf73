// fsdp-train's step: micro-batches, loss scaling, the skip decision, clipping. See step.h.
#include "step.h"

#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "fsdp/errors.h"
#include "fsdp/memory.h"
#include "metrics.h"
#include "sysinfo/sysinfo.h"

namespace train {
namespace {

// A phase of the step: a span `name` of the trace, its seconds added to `into` (a PhaseTimes
// field) and, with `peak`, the most RSS it reached kept there (fsdp::sysinfo::peak_rss_bytes).
class PhaseTimer {
 public:
  PhaseTimer(fsdp::Tracer* tracer, const char* name, double& into, int64_t* peak = nullptr)
      : span_(tracer, name, "train", ""), into_(into), peak_(peak), t0_(std::chrono::steady_clock::now()) {
    if (peak_ != nullptr) fsdp::sysinfo::reset_peak_rss();
  }
  ~PhaseTimer() {
    into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    if (peak_ != nullptr) *peak_ = std::max(*peak_, fsdp::sysinfo::peak_rss_bytes());
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  fsdp::Tracer::Scope span_;
  double& into_;
  int64_t* peak_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

int64_t bytes_in_use(const c10::Device& device) {
  if (device.is_cpu()) return fsdp::sysinfo::heap_in_use_bytes();
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

nlohmann::json scaler_json(const fsdp::GradScaler& scaler) {
  const auto& st = scaler.state();
  return {{"scale", st.scale},
          {"growth_tracker", st.growth_tracker},
          {"skipped_steps", st.skipped_steps},
          {"consecutive_skips", st.consecutive_skips}};
}

void restore_scaler(fsdp::GradScaler& scaler, const nlohmann::json& extra) {
  if (!extra.is_object() || !extra.contains("grad_scaler")) return;
  const auto& j = extra.at("grad_scaler");
  try {
    fsdp::GradScalerState st;
    st.scale = j.at("scale").get<double>();
    st.growth_tracker = j.at("growth_tracker").get<int64_t>();
    st.skipped_steps = j.at("skipped_steps").get<int64_t>();
    st.consecutive_skips = j.at("consecutive_skips").get<int64_t>();
    scaler.load_state(st);
  } catch (const std::exception& e) {
    throw std::invalid_argument("checkpoint: train_state.json extra.grad_scaler=" + j.dump() + ": " + e.what());
  }
}

Stepper::Stepper(const TrainConfig& cfg, const Dataset& data, llama::LlamaForCausalLM model,
                 std::shared_ptr<fsdp::FSDPModule> root, fsdp::ShardedOptimizer& optim, c10::Device device, int rank,
                 std::set<int64_t> inject_steps)
    : cfg_(cfg),
      data_(data),
      model_(std::move(model)),
      root_(std::move(root)),
      optim_(optim),
      device_(device),
      rank_(rank),
      inject_steps_(std::move(inject_steps)) {
  scaler_ = std::make_unique<fsdp::GradScaler>(root_, cfg_.fsdp.scaler);
}

// One micro-batch's forward and backward; returns its loss (already divided by the number of
// micro-batches, detached).
at::Tensor Stepper::micro_step(int64_t first, int64_t micro, bool measure, bool inject, fsdp::Tracer* tracer,
                               PhaseTimes& phases) {
  const int64_t accum = cfg_.train.grad_accum_steps;
  Batch batch;
  {
    PhaseTimer t(tracer, "train::data", phases.data);
    batch = micro_batch(data_, first, cfg_.data.batch_size_per_rank, rank_, Split::kTrain, micro, accum);
  }
  const int64_t used0 = measure ? bytes_in_use(device_) : 0;
  const int64_t gathered0 = measure ? fsdp::memory_report(*root_).unsharded_alive : 0;
  at::Tensor loss;
  {
    PhaseTimer t(tracer, "train::forward", phases.forward, peak_of(phases.peak_forward));
    // A test's injected inf goes into the first logit's gradient, or the loss's when chunked.
    auto poison = [](const at::Tensor& g) {
      at::Tensor h = g.clone();
      h.view(-1)[0] = std::numeric_limits<double>::infinity();
      return h;
    };
    if (model_->loss_chunk_tokens() > 0 || model_->vocab_parallel()) {
      loss = fsdp::call(model_, batch.inputs.to(device_), batch.targets.to(device_));
      if (inject && micro == 0) loss.register_hook(poison);
    } else {
      at::Tensor logits = fsdp::call(model_, batch.inputs.to(device_));
      if (inject && micro == 0) logits.register_hook(poison);
      loss = llama::loss(logits, batch.targets.to(device_));
    }
    if (accum > 1) loss = loss / static_cast<double>(accum);
  }
  if (measure) {
    // What the forward keeps for backward, less the gathered parameters still alive.
    measured_.activations = (bytes_in_use(device_) - used0) - (fsdp::memory_report(*root_).unsharded_alive - gathered0);
  }
  {
    PhaseTimer t(tracer, "train::backward", phases.backward, peak_of(phases.peak_backward));
    scaler_->scale(loss).backward();
  }
  if (measure && micro == 0 && accum > 1) {
    const fsdp::MemoryReport r = fsdp::memory_report(*root_);
    measured_.accum_grads = r.unsharded_grads_alive;
    measured_.partial_grads = r.partial_grads;
  }
  return loss.detach();
}

StepOutcome Stepper::run(int64_t first, int64_t step, fsdp::Tracer* tracer) {
  const bool inject = inject_steps_.count(step) > 0;
  const int64_t accum = cfg_.train.grad_accum_steps;
  const bool measure = steps_run_++ == 1;
  StepOutcome out;
  at::Tensor local = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  for (int64_t m = 0; m < accum; ++m) {
    // no_sync: gradients stay local and unreduced until the last micro-batch, whose backward reduces
    // the sum. reduce_scatter: each micro-batch's are reduce-scattered, the replicas' all-reduce
    // waits for the last. reduce: each micro-batch's are reduced in full.
    const bool last = m == accum - 1;
    const fsdp::Accumulation how = cfg_.train.accumulation;
    root_->set_requires_gradient_sync(last || how != fsdp::Accumulation::kNoSync);
    root_->set_requires_all_reduce(last || how != fsdp::Accumulation::kReduceScatter);
    if (cfg_.train.keep_gathered && accum > 1) {
      // Gathered once per step: kept from forward to backward and, but for the last micro-batch,
      // after backward too (the next micro-batch finds every unit gathered).
      root_->set_reshard_after_forward(false);
      root_->set_reshard_after_backward(last);
    }
    local += micro_step(first, m, measure && m == 0, inject, tracer, out.phases).to(at::kDouble);
  }
  out.local_loss = local.item<double>();
  if (cfg_.optim.step_in_backward) return finish_in_backward(step, local, tracer, out.phases);
  bool skip;
  {
    PhaseTimer t(tracer, "train::check_finite", out.phases.check_finite, peak_of(out.phases.peak_optimizer));
    // With clipping on, the clipping norm decides for the gradients (no second pass over them).
    skip = scaler_->unscale_and_check(local, /*gradients_by_norm=*/cfg_.optim.grad_clip > 0);
  }
  double norm = 0;
  if (!skip && cfg_.optim.grad_clip > 0) {
    PhaseTimer t(tracer, "train::clip_grad_norm", out.phases.clip, peak_of(out.phases.peak_optimizer));
    norm = fsdp::clip_grad_norm(*root_, cfg_.optim.grad_clip);
    out.grad_norm = norm;
  }
  {
    PhaseTimer t(tracer, "train::optimizer", out.phases.optimizer, peak_of(out.phases.peak_optimizer));
    out.stepped = scaler_->step(optim_, norm);
    optim_.zero_grad();
  }
  if (!out.stepped) out.grad_norm = -1;
  return out;
}

// optim.step_in_backward: the backward has applied most of the step already, so nothing can skip
// it; the optimizer finishes it, then every rank learns whether any loss or gradient was
// non-finite (one all-reduce; the gradient shards are still there until zero_grad) and, if so, all
// stop before the step is saved: the last checkpoint stays the latest.
StepOutcome Stepper::finish_in_backward(int64_t step, const at::Tensor& local, fsdp::Tracer* tracer,
                                        PhaseTimes phases) {
  StepOutcome out;
  out.phases = phases;
  out.local_loss = local.item<double>();
  {
    PhaseTimer t(tracer, "train::optimizer", out.phases.optimizer, peak_of(out.phases.peak_optimizer));
    optim_.step();
  }
  out.stepped = true;
  bool bad;
  {
    PhaseTimer t(tracer, "train::check_finite", out.phases.check_finite, peak_of(out.phases.peak_optimizer));
    bad = scaler_->unscale_and_check(local, /*gradients_by_norm=*/false);
  }
  optim_.zero_grad();
  if (bad) {
    throw fsdp::NonFiniteError("fsdp-train: a non-finite loss or gradient at step " + std::to_string(step) +
                               " with optim.step_in_backward, whose steps are applied during backward and cannot "
                               "be skipped: the parameters may be non-finite now, so training stopped before "
                               "saving them; resume from the last checkpoint with a lower optim.lr, or turn "
                               "optim.step_in_backward off to skip such steps");
  }
  return out;
}

}  // namespace train
