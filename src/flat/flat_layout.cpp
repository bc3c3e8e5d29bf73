// See flat/flat_layout.h.
#include "flat/flat_layout.h"

#include <algorithm>

#include "fsdp/errors.h"
#include "frozen/frozen_storage.h"

namespace fsdp {

FlatLayout::FlatLayout(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
                       Communicator& replicate_group)
    : entries_(std::move(entries)),
      config_(std::move(config)),
      shard_group_(shard_group),
      replicate_group_(replicate_group) {
  const int64_t world = shard_group_.size();
  const bool blocks = !config_.requires_grad && frozen::quantized(config_.storage);
  for (auto& e : entries_) {
    e.shape = e.param.sizes().vec();
    e.numel = e.param.numel();
    // Quantized: each parameter starts a block, as when quantized alone (Note [Frozen storage]).
    if (blocks) numel_ = (numel_ + frozen::kBlock - 1) / frozen::kBlock * frozen::kBlock;
    e.offset = numel_;
    numel_ += e.numel;
  }
  // Quantization blocks never straddle ranks either.
  const int64_t align = world * (blocks ? frozen::kBlock : 1);
  padded_numel_ = (numel_ + align - 1) / align * align;
  shard_numel_ = padded_numel_ / world;
  shard_offset_ = shard_numel_ * shard_group_.rank();
  meta_ = entries_.front().param.is_meta();
  for (const auto& e : entries_) {
    if (e.param.is_meta() != meta_) {
      throw ConfigError("fsdp: parameter '" + e.name + "' is " + (meta_ ? "not " : "") +
                        "on the meta device while others of its unit are; initialise all or none lazily");
    }
    if (!meta_ && e.param.device() != config_.device) {
      throw ConfigError("fsdp: parameter '" + e.name + "' is on " + e.param.device().str() +
                        " but the process group computes on " + config_.device.str() +
                        " (InitOptions::device): move the module there first, or build it on the meta device");
    }
  }
}

int64_t FlatLayout::values_in_shard() const { return std::clamp<int64_t>(numel_ - shard_offset_, 0, shard_numel_); }

at::TensorOptions FlatLayout::compute_options() const {
  return at::TensorOptions().dtype(config_.compute_dtype).device(config_.device);
}

void FlatLayout::zero_gaps(const at::Tensor& values) const {
  const int64_t lo = shard_offset_, hi = lo + shard_numel_;
  int64_t end = lo;  // elements before it are a parameter's or zeroed
  for (const auto& e : entries_) {
    if (const int64_t b = std::min(hi, e.offset); end < b) values.narrow(0, end - lo, b - end).zero_();
    end = std::max(end, std::min(hi, e.offset + e.numel));
  }
  if (end < hi) values.narrow(0, end - lo, hi - end).zero_();
}

}  // namespace fsdp
