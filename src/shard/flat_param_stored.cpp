// FlatParam's stored form as loads and saves see it (see flat_param.h): a frozen flat param kept
// in a stored form (Note [Frozen storage] in kernels/cpu/blocks.cpp) gives its values as fp32 and
// takes new ones, whole (store_frozen) or chunk by chunk as a load reads them (store_values).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "offload/frozen_storage.h"
#include "offload/residency.h"
#include "shard/flat_param.h"

namespace fsdp {

void FlatParam::frozen_values_into(const at::Tensor& out) const {
  if (needs_encode_) {
    out.zero_();  // not materialised yet
    return;
  }
  frozen::decode(config_.storage, residency_->master(), out);
}

void FlatParam::store_frozen(const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  // What lies outside every parameter (a gap to a parameter's next block, the padding) is zero,
  // whatever a load left there: it shares a block's absmax with the parameter before it.
  const int64_t lo = shard_offset_, hi = lo + shard_numel_;
  int64_t end = lo;  // elements before it are a parameter's or zeroed
  for (const auto& e : entries_) {
    if (const int64_t b = std::min(hi, e.offset); end < b) values.narrow(0, end - lo, b - end).zero_();
    end = std::max(end, std::min(hi, e.offset + e.numel));
  }
  if (end < hi) values.narrow(0, end - lo, hi - end).zero_();
  residency_->encode_stored(config_.storage, values, /*in_place=*/!needs_encode_);  // deferred init: fp32 values
  needs_encode_ = false;
  loaded();
  drop_stale_gather();
}

void FlatParam::store_values(int64_t begin, const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  const FrozenStorage s = config_.storage;
  if (needs_encode_) {  // deferred init left the values to this load: the stored form starts here
    const auto options = at::TensorOptions().dtype(frozen::stored_dtype(s)).device(config_.device);
    residency_->replace_stored(at::empty({frozen::stored_numel(s, shard_numel_)}, options));
    int64_t pad = values_in_shard();  // the padding's blocks: zeros
    if (frozen::quantized(s)) pad = (pad + frozen::kBlock - 1) / frozen::kBlock * frozen::kBlock;
    if (pad < shard_numel_)
      frozen::encode_range(s, at::zeros({shard_numel_ - pad}, at::kFloat), residency_->master(), shard_numel_, pad);
    needs_encode_ = false;
  }
  frozen::encode_range(s, values, residency_->master(), shard_numel_, begin);
  values_stored_ = true;
}

void FlatParam::end_store_values() {
  values_stored_ = false;
  loaded();
  drop_stale_gather();
}

int64_t FlatParam::stored_bytes() const {
  const at::Tensor& m = residency_->master();
  return static_cast<int64_t>(m.numel() * m.element_size());
}

}  // namespace fsdp
