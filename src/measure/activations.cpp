// fsdp::measure_activations (fsdp/measure.h): a unit's activation bytes from three short runs of it.
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/autograd.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>

#include "fsdp/errors.h"
#include "fsdp/measure.h"

namespace fsdp {
namespace {

// Counts the CPU allocator's bytes on this thread while installed: LibTorch's CPU allocator
// reports each allocation and free to the thread's memory-reporting hook when it is enabled.
class AllocationCounter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void*, int64_t bytes, size_t, size_t, c10::Device device) override {
    if (device.type() != c10::kCPU) return;
    live_ += bytes;
    peak_ = std::max(peak_, live_);
  }
  bool memoryProfilingEnabled() const override { return true; }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_; }

 private:
  int64_t live_ = 0, peak_ = 0;
};

struct Probe {
  int64_t kept = 0;      // alive after forward, its output excluded
  int64_t output = 0;    // the output's bytes
  int64_t backward = 0;  // the backward's highest point beyond the kept bytes
};

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

Probe probe(torch::nn::Module& block, const UnitForwardFn& forward, int64_t seq_len, at::ScalarType dtype) {
  auto counter = std::make_shared<AllocationCounter>();
  Probe p;
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, counter);
    at::Tensor out = forward(1, seq_len, dtype);
    if (!out.defined()) throw ConfigError("fsdp::measure_activations: the unit's forward returned no tensor");
    p.output = tensor_bytes(out);
    p.kept = std::max<int64_t>(0, counter->live() - p.output);
    if (out.requires_grad()) {
      // The parameters' gradients exist before the backward (fsdp's gradient buffer): accumulating
      // into them allocates only the transient a gradient buffer's copy-in has too.
      for (auto& param : block.parameters()) {
        if (param.requires_grad()) param.mutable_grad() = at::zeros_like(param);
      }
      const int64_t before = counter->live();
      counter->reset_peak();
      out.backward(at::ones_like(out));
      p.backward = std::max<int64_t>(0, counter->peak() - before);
    }
  }
  for (auto& param : block.parameters()) param.mutable_grad() = at::Tensor();
  return p;
}

// bytes(batch, s) = c + batch (a s + b s^2) through probes at s, 2s and 3s (batch 1): c is what
// does not grow with the input (a parameter-sized transient, e.g. an embedding's dense gradient),
// a the per-token bytes, b attention's per-token-pair bytes.
int64_t fit(const int64_t at[3], int64_t s, int64_t batch, int64_t seq_len) {
  const double y1 = static_cast<double>(at[0]), y2 = static_cast<double>(at[1]), y3 = static_cast<double>(at[2]);
  const double x = static_cast<double>(s);
  // Second differences give b, first differences a, then c.
  const double b = std::max(0.0, (y3 - 2.0 * y2 + y1) / (2.0 * x * x));
  const double a = std::max(0.0, (y2 - y1) / x - 3.0 * b * x);
  const double c = std::max(0.0, y1 - a * x - b * x * x);
  const double t = static_cast<double>(seq_len);
  return static_cast<int64_t>(c + static_cast<double>(batch) * (a * t + b * t * t) + 0.5);
}

// The probes of one unit, run once per dtype when the plan first asks.
class Measured {
 public:
  Measured(std::shared_ptr<torch::nn::Module> block, UnitForwardFn forward, int64_t s)
      : block_(std::move(block)), forward_(std::move(forward)), s_(s) {}
  // The probes at s, 2s and 3s for `dtype`.
  std::array<Probe, 3> at(at::ScalarType dtype) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(dtype);
    if (it == cache_.end()) {
      std::array<Probe, 3> probes;
      for (int k = 0; k < 3; ++k) probes[k] = probe(*block_, forward_, (k + 1) * s_, dtype);
      it = cache_.emplace(dtype, probes).first;
    }
    return it->second;
  }
  int64_t s() const { return s_; }

 private:
  std::shared_ptr<torch::nn::Module> block_;
  UnitForwardFn forward_;
  int64_t s_;
  std::mutex mu_;
  std::map<at::ScalarType, std::array<Probe, 3>> cache_;
};

// A backward's peak is the largest of its moments: at small inputs a parameter-sized transient can
// be the largest, at larger ones what grows with the input. So a line through the two larger runs:
// c + batch x a x seq_len.
int64_t fit_peak(const std::array<Probe, 3>& probes, int64_t s, int64_t batch, int64_t seq_len) {
  const double y2 = static_cast<double>(probes[1].backward), y3 = static_cast<double>(probes[2].backward);
  const double x = static_cast<double>(s);
  const double a = std::max(0.0, (y3 - y2) / x);
  const double c = std::max(0.0, y3 - 3.0 * a * x);
  return static_cast<int64_t>(c + static_cast<double>(batch) * a * static_cast<double>(seq_len) + 0.5);
}

template <typename Field>
int64_t fit_field(const std::array<Probe, 3>& probes, Field field, int64_t s, int64_t batch, int64_t seq_len) {
  const int64_t at[3] = {probes[0].*field, probes[1].*field, probes[2].*field};
  return fit(at, s, batch, seq_len);
}

}  // namespace

void measure_activations(UnitShape& unit, std::shared_ptr<torch::nn::Module> block, UnitForwardFn forward,
                         int64_t probe_seq_len) {
  if (!block) throw ConfigError("fsdp::measure_activations: unit '" + unit.name + "' has no block to run");
  if (!forward) throw ConfigError("fsdp::measure_activations: unit '" + unit.name + "' has no forward to run");
  if (probe_seq_len < 1) {
    throw ConfigError("fsdp::measure_activations: probe_seq_len must be at least 1, got " +
                      std::to_string(probe_seq_len));
  }
  auto m = std::make_shared<Measured>(std::move(block), std::move(forward), probe_seq_len);
  unit.activations = [m](int64_t batch, int64_t seq_len, at::ScalarType dtype, bool checkpointed) {
    return fit_field(m->at(dtype), checkpointed ? &Probe::output : &Probe::kept, m->s(), batch, seq_len);
  };
  unit.backward_peak = [m](int64_t batch, int64_t seq_len, at::ScalarType dtype) {
    return fit_peak(m->at(dtype), m->s(), batch, seq_len);
  };
}

}  // namespace fsdp
