// The streamed optimizer step over disk-tier tensors. See streamed_step.h.
#include "shard/streamed_step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "fsdp/errors.h"
#include "tiers/disk_tier.h"
#include "shard/flat_param.h"

namespace fsdp::offload {

bool needs_streaming(const ShardState& s, const at::Tensor& param, const at::Tensor& grad) {
  if (is_disk_backed(param) || is_disk_backed(grad)) return true;
  for (const auto& [name, t] : s.tensors) {
    if (is_disk_backed(t)) return true;
  }
  return false;
}

void step_in_chunks(ShardState& s, at::Tensor& param, const at::Tensor& grad, const ShardStepFn& step) {
  std::vector<at::Tensor> all{param, grad};
  for (const auto& [name, t] : s.tensors) {
    if (!t.defined()) {
      // e.g. SGD's momentum buffer, created by its first step: a chunk could not create it whole.
      throw ConfigError("fsdp: " + (s.tag.empty() ? std::string("?") : s.tag) + ": optimizer state '" + name +
                        "' does not exist before its first step, so the step cannot stream through the disk tier; "
                        "offload params and optimizer_state to \"none\" or \"host\" with this optimizer");
    }
    all.push_back(t);
  }
  DiskTier* tier = nullptr;
  int streamed = 0;
  for (const auto& t : all) {
    if (DiskTier* d = tier_of(t)) {
      tier = d;
      ++streamed;
    }
  }
  const int64_t n = param.numel();
  const int64_t chunk = tier->chunk_elements(streamed);
  auto each = [&](int64_t a, int64_t b, void (*fn)(const at::Tensor&, int64_t, int64_t)) {
    if (a >= b) return;
    for (const auto& t : all) fn(t, a, b);
  };
  each(0, std::min(n, chunk), &will_need);
  for (int64_t a = 0; a < n; a += chunk) {
    const int64_t b = std::min(n, a + chunk);
    each(b, std::min(n, b + chunk), &will_need);  // read-ahead: chunk k+1 comes in while k computes
    ShardState view;
    view.flat_index = s.flat_index;
    view.tag = s.tag;
    view.step = s.step;
    for (const auto& [name, t] : s.tensors) view.tensors[name] = t.defined() ? t.narrow(0, a, b - a) : t;
    at::Tensor p = param.narrow(0, a, b - a);
    const at::Tensor g = grad.narrow(0, a, b - a);
    step(view, p, g);
    for (const auto& [name, t] : s.tensors) {
      const auto& v = view.tensors[name];
      if (t.defined() != v.defined() || (t.defined() && v.data_ptr() != t.narrow(0, a, b - a).data_ptr())) {
        throw ConfigError("fsdp: the optimizer replaced its state tensor '" + name + "' of " +
                          (s.tag.empty() ? std::string("?") : s.tag) +
                          " instead of updating it in place; its state cannot be offloaded (use offload "
                          "optimizer_state \"none\", or an optimizer whose state exists from the first step)");
      }
    }
    each(a, b, &write_behind);  // write-behind: chunk k goes to disk while k+1 computes
    tier->audit();
    if (a > 0) each(a - chunk, a, [](const at::Tensor& t, int64_t x, int64_t y) { release(t, x, y); });
  }
  const int64_t last = n == 0 ? 0 : (n - 1) / chunk * chunk;
  each(last, n, [](const at::Tensor& t, int64_t x, int64_t y) { release(t, x, y); });
  tier->audit();
}

}  // namespace fsdp::offload
