// StoredShard: a frozen flat param's shard kept in a stored form (FrozenStorage: bf16 or fp16, or
// int8 or NF4 blocks by the kernels' codec, Note [Frozen storage] in kernels/cpu/blocks.cpp) as
// its builds, loads, saves and gathers see it. The stored form itself is the Residency's master
// (offload/residency.h), in whatever tier it is placed; this is the state around it: whether the
// master still holds fp32 values that wait to be encoded, and a load's range by range writes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "base/file_io.h"
#include "fsdp/frozen_storage.h"

namespace fsdp {

namespace offload {
class Residency;
}
using offload::Residency;

// Whole NF4 blocks of a load whose codes stay in a file (StoredShard::store_codes_in_place): their
// absmax (fp32, asked for only when the stored form takes them), the file and the codes' offset.
struct CodesInFile {
  std::function<at::Tensor()> absmax;
  std::shared_ptr<const io::File> file;
  int64_t offset = 0;
};

class StoredShard {
 public:
  // Kept stored when frozen with a storage other than kFloat32; `meta`: deferred init or a load
  // fills the values later, so the master holds fp32 values until then.
  StoredShard(FrozenStorage storage, bool requires_grad, bool meta);

  bool active() const { return active_; }
  FrozenStorage storage() const { return storage_; }
  // Deferred init left fp32 values in the master, to be encoded once filled.
  bool awaits_encode() const { return awaits_encode_; }
  // A gather of it decodes into the compute dtype (int8 / NF4, or a floating form of another dtype).
  bool decodes_to(at::ScalarType compute) const;
  // The stored form of an fp32 shard built from the parameters (itself unless stored).
  at::Tensor initial(const at::Tensor& fp32_shard) const;
  // Stored form (`stored`, a whole shard or rank by rank) decoded into `out`.
  void decode(const at::Tensor& stored, const at::Tensor& out) const;

  // ---- through the residency's master
  // Deferred init filled the fp32 values: they are encoded into the stored form.
  void encode_filled(Residency& residency);
  // The shard as fp32 values into `out` (zeros while it awaits its values), for a save.
  void values_into(const Residency& residency, const at::Tensor& out) const;
  // Replaces the shard's values with `values` (fp32, gaps and padding zero), stored again.
  void store(Residency& residency, const at::Tensor& values);
  // A load stores elements [begin, ...) of the shard (`begin` starts a block) from `values` (any
  // floating dtype, host), with no fp32 copy of the shard; end_ranges() ends the load.
  // `values_in_shard`: the elements that hold parameters (the blocks after them are zeros).
  void store_range(Residency& residency, int64_t begin, const at::Tensor& values, int64_t shard_numel,
                   int64_t values_in_shard);
  // The same for whole NF4 blocks [begin, begin + count): `absmax()` written, their codes read from
  // `file` at `offset` whenever the stored form is read (Note [NF4 codes read in place],
  // offload/residency.cpp). False, nothing done, unless the stored form is NF4 in the disk tier.
  bool store_codes_in_place(Residency& residency, int64_t begin, int64_t count, const CodesInFile& codes,
                            int64_t shard_numel, int64_t values_in_shard);
  bool ranges_stored() const { return ranges_stored_; }  // store_range() since the last end_ranges()
  void end_ranges(Residency& residency);

 private:
  void start_ranges(Residency& residency, int64_t shard_numel, int64_t values_in_shard);

  FrozenStorage storage_;
  bool active_ = false;
  bool awaits_encode_ = false;
  bool ranges_stored_ = false;
};

}  // namespace fsdp
