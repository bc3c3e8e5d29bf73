// See flat/stored_shard.h.
#include "flat/stored_shard.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "frozen/frozen_storage.h"
#include "offload/residency.h"
#include "offload/tier_tensors.h"

namespace fsdp {

StoredShard::StoredShard(FrozenStorage storage, bool requires_grad, bool meta)
    : storage_(storage), active_(!requires_grad && storage != FrozenStorage::kFloat32) {
  awaits_encode_ = meta && active_;
}

bool StoredShard::decodes_to(at::ScalarType compute) const {
  return active_ && frozen::stored_dtype(storage_) != compute;
}

at::Tensor StoredShard::initial(const at::Tensor& fp32_shard) const {
  return active_ && !awaits_encode_ ? frozen::encode(storage_, fp32_shard) : fp32_shard;
}

void StoredShard::decode(const at::Tensor& stored, const at::Tensor& out) const {
  c10::NoGradGuard no_grad;
  frozen::decode(storage_, stored, out);
}

void StoredShard::encode_filled(Residency& residency) {
  if (!awaits_encode_) return;
  residency.replace_stored(frozen::encode(storage_, residency.master()));
  awaits_encode_ = false;
}

void StoredShard::values_into(const Residency& residency, const at::Tensor& out) const {
  if (awaits_encode_) {
    out.zero_();  // not materialised yet
    return;
  }
  frozen::decode(storage_, residency.stored_bytes(), out);
  offload::release(residency.master());  // a disk-tier stored form's pages, read through the mapping
}

void StoredShard::store(Residency& residency, const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  residency.encode_stored(storage_, values, /*in_place=*/!awaits_encode_);  // deferred init: fp32 values
  awaits_encode_ = false;
}

void StoredShard::start_ranges(Residency& residency, int64_t shard_numel, int64_t values_in_shard) {
  if (!awaits_encode_) return;
  // Deferred init left the values to this load: the stored form starts here.
  residency.allocate_stored(frozen::stored_dtype(storage_), frozen::stored_numel(storage_, shard_numel));
  int64_t pad = values_in_shard;  // the padding's blocks: zeros
  if (frozen::quantized(storage_)) pad = (pad + frozen::kBlock - 1) / frozen::kBlock * frozen::kBlock;
  if (pad < shard_numel)
    frozen::encode_range(storage_, at::zeros({shard_numel - pad}, at::kFloat), residency.master(), shard_numel, pad);
  awaits_encode_ = false;
}

void StoredShard::store_range(Residency& residency, int64_t begin, const at::Tensor& values, int64_t shard_numel,
                              int64_t values_in_shard) {
  c10::NoGradGuard no_grad;
  start_ranges(residency, shard_numel, values_in_shard);
  if (storage_ == FrozenStorage::kNF4) {  // the codes this writes: none of them is read in place after it
    const int64_t blocks = values.scalar_type() == at::kByte ? values.numel() / (frozen::kBlock / 2 + 4)
                                                             : (values.numel() + frozen::kBlock - 1) / frozen::kBlock;
    residency.before_stored_write(begin / 2, begin / 2 + blocks * frozen::kBlock / 2);
  }
  frozen::encode_range(storage_, values, residency.master(), shard_numel, begin);
  residency.stored_written();
  ranges_stored_ = true;
}

bool StoredShard::store_codes_in_place(Residency& residency, int64_t begin, int64_t count, const CodesInFile& codes,
                                       int64_t shard_numel, int64_t values_in_shard) {
  if (storage_ != FrozenStorage::kNF4 || !residency.stored_in_disk_tier()) return false;
  c10::NoGradGuard no_grad;
  start_ranges(residency, shard_numel, values_in_shard);
  const int64_t blocks = count / frozen::kBlock;
  residency.master()
      .narrow(0, shard_numel / 2 + begin / frozen::kBlock * 4, blocks * 4)
      .copy_(codes.absmax().view(at::kByte));
  residency.before_stored_write(begin / 2, begin / 2 + count / 2);  // a second import over the first
  residency.read_in_place(begin / 2, count / 2, codes.file, codes.offset);
  residency.stored_written();
  ranges_stored_ = true;
  return true;
}

void StoredShard::end_ranges(Residency& residency) {
  ranges_stored_ = false;
  residency.punch_in_place();
}

}  // namespace fsdp
