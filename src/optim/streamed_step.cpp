// The streamed optimizer step over disk-tier tensors. See streamed_step.h.
#include "optim/streamed_step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <vector>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "offload/tier_rules.h"
#include "offload/tier_tensors.h"

namespace fsdp::offload {
namespace {

// One chunk of one job: elements [a, b) of its master and states.
struct Chunk {
  size_t job = 0;
  int64_t a = 0, b = 0;
  int64_t bytes = 0;                                    // host buffer bytes its reads take
  std::vector<std::pair<std::string, IoTicket>> reads;  // "param" and the disk-tier state tensors
  bool issued = false;
};

std::string tag_of(const ShardState& s) { return s.tag.empty() ? std::string("?") : s.tag; }

// The bytes of budgeted buffers the step holds at most (offload/tier_rules.h).
int64_t window_of(const DiskTier& tier, int64_t chunk_bytes) { return step_window(tier.budget_bytes(), chunk_bytes); }

void check_streamable(const StepJob& job) {
  for (const auto& [name, t] : job.state->tensors) {
    if (!t.defined()) {
      // e.g. SGD's momentum buffer, created by its first step: a chunk could not create it whole.
      throw ConfigError("fsdp: " + tag_of(*job.state) + ": optimizer state '" + name +
                        "' does not exist before its first step, so the step cannot stream through the disk tier; "
                        "offload params and optimizer_state to \"none\" or \"host\" with this optimizer");
    }
  }
}

// The disk tier of the job's master or state, or null.
DiskTier* tier_of_job(const StepJob& job) {
  DiskTier* tier = tier_of(job.param);
  for (const auto& [name, t] : job.state->tensors) tier = tier != nullptr ? tier : tier_of(t);
  return tier;
}

// How a job streams: tensors moved through the tier per chunk, elements per chunk, and the host
// bytes one chunk's reads take (whole pages: a shard shorter than a page still takes one).
struct Streaming {
  int streamed = 0;
  int64_t chunk = 0;
  int64_t bytes_per(int64_t elements, bool grad_on_disk) const {
    return (streamed - (grad_on_disk ? 1 : 0)) * whole_pages(elements * static_cast<int64_t>(sizeof(float)));
  }
};

Streaming streaming_of(const StepJob& job, DiskTier& tier) {
  Streaming st;
  const bool read_master = is_disk_backed(job.param) && !job.param_values.defined();
  st.streamed = (read_master ? 1 : 0) + (job.grad_on_disk ? 1 : 0);
  for (const auto& [name, t] : job.state->tensors) st.streamed += is_disk_backed(t) ? 1 : 0;
  st.chunk = tier.chunk_elements(std::max(st.streamed, 1), tag_of(*job.state));
  return st;
}

// The reads of a chunk: the master unless its values came with the job, and each disk-tier state.
std::vector<std::pair<std::string, IoTicket>> issue_reads(const StepJob& job, DiskTier& tier, int64_t a, int64_t b) {
  std::vector<std::pair<std::string, IoTicket>> reads;
  const std::string tag = tag_of(*job.state);
  if (is_disk_backed(job.param) && !job.param_values.defined()) {
    reads.emplace_back("", tier.read_async(job.param, a, b, "the master shard of " + tag, true));
  }
  for (const auto& [name, t] : job.state->tensors) {
    if (is_disk_backed(t)) reads.emplace_back(name, tier.read_async(t, a, b, name + " of " + tag, true));
  }
  return reads;
}

class Pipeline {
 public:
  Pipeline(std::vector<StepJob>& jobs, DiskTier& tier, Tracer* tracer) : jobs_(jobs), tier_(tier), tracer_(tracer) {}

  void plan() {
    int64_t largest = 0;
    for (size_t j = 0; j < jobs_.size(); ++j) {
      const StepJob& job = jobs_[j];
      if (!needs_streaming(job)) continue;
      check_streamable(job);
      const Streaming st = streaming_of(job, tier_);
      const int64_t n = job.param.numel();
      for (int64_t a = 0; a < n; a += st.chunk) {
        Chunk c;
        c.job = j;
        c.a = a;
        c.b = std::min(n, a + st.chunk);
        c.bytes = st.bytes_per(c.b - c.a, job.grad_on_disk);
        if (a == 0 && jobs_[j].first_end == c.b) {  // read already (prefetch_first_chunk)
          c.reads = std::move(jobs_[j].first_reads);
          c.issued = true;
        }
        largest = std::max(largest, c.bytes);
        chunks_.push_back(std::move(c));
      }
    }
    window_ = window_of(tier_, largest);
  }

  void run(bool flush) {
    size_t next_chunk = 0;
    for (size_t j = 0; j < jobs_.size(); ++j) {
      StepJob& job = jobs_[j];
      if (!needs_streaming(job)) {
        at::Tensor grad = job.prepare();
        if (!grad.defined()) continue;
        job.step(*job.state, job.param, grad);
        if (job.after) job.after(0, job.param.numel(), job.param);
        if (job.observe) job.observe(*job.state, 0, job.param.numel(), job.param, job.state->tensors);
        continue;
      }
      const size_t begin = next_chunk;
      size_t end = begin;
      while (end < chunks_.size() && chunks_[end].job == j) ++end;
      next_chunk = end;
      at::Tensor grad = job.prepare();
      if (!grad.defined()) {
        for (size_t k = begin; k < end; ++k) chunks_[k].reads.clear();  // read ahead for nothing
        continue;
      }
      for (size_t k = begin; k < end; ++k) step_chunk(k, grad);
    }
    if (flush) tier_.flush();
    tier_.audit();
  }

 private:
  void issue(Chunk& c) {
    c.reads = issue_reads(jobs_[c.job], tier_, c.a, c.b);
    c.issued = true;
  }

  // Issues the reads of chunk k and of the chunks after it that fit in the window (at most two
  // ahead); chunk k itself waits for room if the write-behind still holds it.
  void read_ahead(size_t k) {
    if (!chunks_[k].issued) {
      tier_.wait_for_buffers(chunks_[k].bytes, window_);
      std::lock_guard<std::mutex> lock(tier_.budget_mutex());
      issue(chunks_[k]);
    }
    // Checking for room and taking it are one step: the training thread prefetches too.
    std::lock_guard<std::mutex> lock(tier_.budget_mutex());
    for (size_t n = k + 1; n < chunks_.size() && n <= k + 2; ++n) {
      if (chunks_[n].issued) continue;
      if (tier_.buffered_bytes() + chunks_[n].bytes > window_) break;
      issue(chunks_[n]);
    }
  }

  void step_chunk(size_t k, const at::Tensor& grad) {
    read_ahead(k);
    Chunk& c = chunks_[k];
    StepJob& job = jobs_[c.job];
    const int64_t a = c.a, b = c.b;
    {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& [name, ticket] : c.reads) ticket.wait();
      if (tracer_ != nullptr) {
        tracer_->span("fsdp::disk_read_wait", "disk wait", t0, std::chrono::steady_clock::now(), job.state->tag);
      }
    }
    auto buffer_of = [&](const std::string& name) -> at::Tensor {
      for (auto& [n, ticket] : c.reads) {
        if (n == name) return ticket.buffer();
      }
      return at::Tensor();
    };
    ShardState view;
    view.flat_index = job.state->flat_index;
    view.tag = job.state->tag;
    view.step = job.state->step;
    view.offset = job.state->offset + a;
    for (const auto& [name, t] : job.state->tensors) {
      at::Tensor buf = buffer_of(name);
      view.tensors[name] = buf.defined() ? buf : t.narrow(0, a, b - a);
    }
    std::map<std::string, const void*> expected;
    for (const auto& [name, t] : view.tensors) expected[name] = t.data_ptr();
    at::Tensor p = job.param_values.defined()  ? job.param_values.narrow(0, a, b - a)
                   : is_disk_backed(job.param) ? buffer_of("")
                                               : job.param.narrow(0, a, b - a);
    at::Tensor g;
    if (job.grad_on_disk && is_disk_backed(grad)) {
      IoTicket t = tier_.read_async(grad, a, b, "the gradient shard of " + job.state->tag, true);
      t.wait();
      g = t.buffer();
    } else {
      g = grad.narrow(0, a, b - a);
    }
    job.step(view, p, g);
    for (const auto& [name, t] : view.tensors) {
      if (!t.defined() || t.data_ptr() != expected[name]) {
        throw ConfigError("fsdp: the optimizer replaced its state tensor '" + name + "' of " + tag_of(*job.state) +
                          " instead of updating it in place; its state cannot be offloaded (use offload "
                          "optimizer_state \"none\", or an optimizer whose state exists from the first step)");
      }
    }
    if (job.after) job.after(a, b, p);
    if (job.observe) job.observe(*job.state, a, b, p, view.tensors);
    // Write-behind: queued now, waited for at the end of the step (or by a read of the range).
    if (is_disk_backed(job.param)) tier_.write_async(job.param, a, p, "the master shard of " + job.state->tag);
    for (const auto& [name, t] : job.state->tensors) {
      if (is_disk_backed(t)) tier_.write_async(t, a, view.tensors[name], name + " of " + job.state->tag);
    }
    c.reads.clear();  // the write jobs hold the buffers now
    tier_.audit();
  }

  std::vector<StepJob>& jobs_;
  DiskTier& tier_;
  Tracer* tracer_;
  std::vector<Chunk> chunks_;
  int64_t window_ = 0;  // bytes of budgeted buffers the step holds at most
};

}  // namespace

bool needs_streaming(const StepJob& job) {
  if (is_disk_backed(job.param) || job.grad_on_disk) return true;
  for (const auto& [name, t] : job.state->tensors) {
    if (is_disk_backed(t)) return true;
  }
  return false;
}

void prefetch_first_chunk(StepJob& job) {
  DiskTier* tier = needs_streaming(job) ? tier_of_job(job) : nullptr;
  if (tier == nullptr) return;
  for (const auto& [name, t] : job.state->tensors) {
    if (!t.defined()) return;  // the step refuses it (check_streamable)
  }
  Streaming st;
  try {
    st = streaming_of(job, *tier);
  } catch (const ConfigError&) {
    return;  // the step reports it
  }
  const int64_t end = std::min(job.param.numel(), st.chunk);
  const int64_t chunk_bytes = st.bytes_per(st.chunk, job.grad_on_disk);
  // Prefetched reads are held until their job runs, so the running job could not wait for them to
  // make room: they leave room for two of its chunks (the one it steps and the next).
  std::lock_guard<std::mutex> lock(tier->budget_mutex());
  if (tier->buffered_bytes() + st.bytes_per(end, job.grad_on_disk) + 2 * chunk_bytes > window_of(*tier, chunk_bytes))
    return;
  job.first_reads = issue_reads(job, *tier, 0, end);
  job.first_end = end;
}

void run_step(std::vector<StepJob>& jobs, Tracer* tracer, RunOptions options) {
  DiskTier* tier = nullptr;
  for (const auto& job : jobs) {
    if (!needs_streaming(job)) continue;
    tier = tier_of_job(job);
    if (tier != nullptr) break;
  }
  if (tier == nullptr) {
    for (auto& job : jobs) {
      at::Tensor grad = job.prepare();
      if (!grad.defined()) continue;
      job.step(*job.state, job.param, grad);
      if (job.after) job.after(0, job.param.numel(), job.param);
      if (job.observe) job.observe(*job.state, 0, job.param.numel(), job.param, job.state->tensors);
    }
    return;
  }
  tier->check_dir();
  Pipeline pipeline(jobs, *tier, tracer);
  pipeline.plan();  // every check before anything steps
  if (options.bump_generation) tier->bump_generation();
  pipeline.run(options.flush);
  if (options.bump_generation) tier->bump_generation();
}

}  // namespace fsdp::offload
