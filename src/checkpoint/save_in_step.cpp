// checkpoint::SaveInStep: a save whose trainable shards are written while the optimizer step
// holds them (Note [A save fused into the step] in fsdp/checkpoint.h).
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>

#include "base/direct_writer.h"
#include "base/file_io.h"
#include "base/strings.h"
#include "checkpoint/save_job.h"
#include "fsdp/checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/optim.h"

namespace fsdp::checkpoint {

struct SaveInStep::Impl {
  explicit Impl(ShardedOptimizer& o) : optimizer(o) {}

  ShardedOptimizer& optimizer;
  SaveJob job;
  std::vector<std::string> kinds;                          // file_kinds(job)
  std::vector<std::map<size_t, std::vector<Run>>> runs;    // per kind: this rank's runs by flat slot
  std::vector<std::unique_ptr<io::DirectWriter>> writers;  // per kind; null where this rank writes nothing
  std::vector<int64_t> expected;                           // per slot: elements of its model-file runs
  std::vector<int64_t> covered;                            // per slot: of those, written during the step
  std::vector<int64_t> step_seen;                          // per slot: its ShardState::step then
  std::mutex mutex;                                        // observe() against the getters and finish()
  std::string error;                                       // the first write that failed during the step
  int64_t bytes = 0;
  bool finished = false;

  // The step's chunk [a, b) of one flat param: every file's runs it overlaps. Never throws (the
  // step must not stop half way): a failure is kept for finish() to report.
  void observe(const ShardState& state, int64_t a, int64_t b, const at::Tensor& master,
               const std::map<std::string, at::Tensor>& states) {
    std::lock_guard<std::mutex> lock(mutex);
    const size_t slot = state.flat_index;
    if (!error.empty() || slot >= covered.size()) return;
    try {
      for (size_t k = 0; k < kinds.size(); ++k) {
        auto it = runs[k].find(slot);
        if (it == runs[k].end()) continue;
        at::Tensor source = master;
        if (k > 0) {  // file "optim." + the optimizer's (k-1)th state name
          auto s = states.find(job.state_names[k - 1]);
          if (s == states.end() || !s->second.defined()) {
            throw CheckpointError("the step did not pass its state '" + job.state_names[k - 1] + "' of " + state.tag);
          }
          source = s->second;
        }
        const at::Tensor values = source.to(at::kCPU, at::kFloat).contiguous();
        const float* data = values.data_ptr<float>();
        for (const Run& run : it->second) {
          const int64_t lo = std::max(a, run.shard_begin), hi = std::min(b, run.shard_begin + run.count);
          if (lo >= hi) continue;
          const int64_t n = (hi - lo) * static_cast<int64_t>(sizeof(float));
          writers[k]->write(data + (lo - a), n, run.at + (lo - run.shard_begin) * static_cast<int64_t>(sizeof(float)));
          bytes += n;
          if (k == 0) covered[slot] += hi - lo;
        }
      }
      step_seen[slot] = state.step;
    } catch (const std::exception& e) {
      error = "while the optimizer stepped " + state.tag + ": " + base::first_line(e);
    }
  }
};

SaveInStep::SaveInStep(const std::string& root_dir, const std::string& name, FSDPModule& root,
                       ShardedOptimizer& optimizer, const SaveOptions& options)
    : impl_(std::make_unique<Impl>(optimizer)) {
  Impl& s = *impl_;
  s.job = make_save_job(root_dir, name, root, &optimizer, TrainState{}, options, /*copy=*/false);
  prepare_phase(s.job);
  s.kinds = file_kinds(s.job);
  const size_t slots = s.job.layout.flats.size();
  s.expected.assign(slots, 0);
  s.covered.assign(slots, 0);
  s.step_seen.assign(slots, -1);
  // Every rank's files open before any rank goes on: a rank that failed to open, or an unfinished
  // one's rank 0 removing the directory, cannot leave another writing nowhere.
  agree_on(s.job, "opening its files for the step", [&s] {
    for (const auto& kind : s.kinds) {
      std::map<size_t, std::vector<Run>> by_slot;
      for (const Run& run : runs_for(s.job, kind, file_plan(s.job, kind))) {
        if (s.job.layout.flats[run.flat].optim_state == nullptr) continue;  // frozen: finish() writes it
        by_slot[run.flat].push_back(run);
        if (kind == "model") s.expected[run.flat] += run.count;
      }
      s.writers.push_back(by_slot.empty()
                              ? nullptr
                              : std::make_unique<io::DirectWriter>(io::join(tmp_dir(s.job), kind + ".safetensors"),
                                                                   io::DirectWriter::kInStepBufferBytes));
      s.runs.push_back(std::move(by_slot));
    }
  });
  Impl* impl = impl_.get();
  optimizer.observe_next_step(
      [impl](const ShardState& state, int64_t a, int64_t b, const at::Tensor& master,
             const std::map<std::string, at::Tensor>& states) { impl->observe(state, a, b, master, states); });
}

SaveInStep::~SaveInStep() {
  if (!impl_ || impl_->finished) return;
  impl_->optimizer.observe_next_step(nullptr);
  impl_->writers.clear();  // each waits for its writes
  if (impl_->job.group->rank() == 0) {
    try {
      io::remove_tree(tmp_dir(impl_->job));  // nothing of it was committed
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the next save of the name clears it
    }
  }
}

std::string SaveInStep::finish(const TrainState& state) {
  Impl& s = *impl_;
  if (s.finished) throw UsageError("fsdp: SaveInStep::finish called twice for checkpoint '" + s.job.name + "'");
  s.optimizer.observe_next_step(nullptr);
  s.finished = true;
  s.job.state = state;
  s.job.rng = rng_state_base64();
  s.job.data = collect_shards(s.job.layout, /*copy=*/false);  // after the step: its states and step counts
  std::vector<char> written(s.job.layout.flats.size(), 0);
  for (size_t slot = 0; slot < written.size(); ++slot) {
    const ShardState* st = s.job.layout.flats[slot].optim_state;
    written[slot] =
        st != nullptr && s.expected[slot] > 0 && s.covered[slot] == s.expected[slot] && s.step_seen[slot] == st->step;
  }
  write_phase(s.job, written, [&s] {
    for (auto& w : s.writers) {
      if (w) w->finish();
    }
    if (!s.error.empty()) throw CheckpointError(s.error);
  });
  commit_phase(s.job);
  return io::join(s.job.root_dir, s.job.name);
}

int64_t SaveInStep::bytes_written_in_step() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->bytes;
}

}  // namespace fsdp::checkpoint
