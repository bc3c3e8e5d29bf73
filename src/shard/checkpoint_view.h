// What the checkpoint layer sees of a sharded model: every parameter by name in the model's own
// order, where it sits in its flat param, and this rank's part of each flat param (its live fp32
// master shard and the flat elements it covers). Values only, apart from the master shard: the
// layout a checkpoint's files take is computed from this alone, so every rank (and every world
// size) agrees on it, and the checkpoint layer never reads ShardedUnit or FlatParam.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "base/file_io.h"
#include "fsdp/dist.h"
#include "fsdp/fully_shard.h"

namespace fsdp::offload {
class RangeWriter;
}

namespace fsdp {

// A sharded state of this rank (a master shard, an optimizer state tensor, or a snapshot of one)
// wherever its offload tier keeps it: RAM, host memory, device memory or a disk-tier file. The
// checkpoint reads and writes its elements through values() and tells it when a range is done
// with, so the tier can let those pages go; it never needs to know which tier that is.
class ShardTensor {
 public:
  ShardTensor() = default;
  explicit ShardTensor(at::Tensor t) : t_(std::move(t)) {}
  bool defined() const { return t_.defined(); }
  int64_t numel() const { return t_.defined() ? t_.numel() : 0; }
  // The 1-D elements: fp32, or bf16 for an optimizer state kept in bf16 (read() and the
  // checkpoint's reads give fp32 either way). Writes land in the state itself (not a copy).
  // Host-addressable (data_ptr) unless on a device.
  const at::Tensor& values() const { return t_; }
  // Elements [begin, end) were read or written: a disk tier writes them back and drops their pages
  // (the data stays).
  void done(int64_t begin, int64_t end) const;
  void done() const { done(0, numel()); }
  // A copy in the same tier (a new disk-tier file for a disk-tier state: no RAM copy), on the
  // host for a device state: a checkpoint's snapshot.
  ShardTensor snapshot() const;
  // Zeros shaped like it, in the same tier; `what` names it in errors.
  ShardTensor zeros_like(const std::string& what) const;
  // Copies `src` into it chunk by chunk, letting disk-tier pages go as it goes.
  void copy_from(const ShardTensor& src) const;
  // fn(data, at, count) over elements [begin, end), in order, in host chunks: the state's own
  // memory in RAM, reads ahead by the disk tier's I/O threads for a disk-tier state (nothing of
  // its mapping is touched, so no done() is needed), copies for a device state.
  void read(int64_t begin, int64_t end, const std::function<void(const float* data, int64_t at, int64_t count)>& fn,
            const std::string& what) const;
  // Whether writes through values() would page through a disk-tier file's mapping (use Writer).
  bool in_file() const;

  // Host fp32 buffers written into ranges of a state: copied into one in memory, written by the
  // disk tier's write thread for a disk-tier state (two in flight; its mapping is not touched,
  // whose write faults would read each page in first). finish() waits and reports an I/O error.
  class Writer {
   public:
    Writer(const ShardTensor& dst, const std::string& what);
    ~Writer();
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;
    void put(int64_t begin, const at::Tensor& src);  // contiguous fp32 host values, not reused after
    void make_room();  // before making the next buffer: at most two exist (RangeWriter::make_room)
    void finish();

   private:
    std::unique_ptr<offload::RangeWriter> w_;
  };

 private:
  at::Tensor t_;
};

// One parameter, tied ones once: a full tensor of the checkpoint's files.
struct ShardedTensorView {
  std::string name;                  // fully qualified, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<std::string> aliases;  // its other fully qualified names (tied weights)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // first element in its flat param (unpadded flat layout)
  size_t flat = 0;     // index into ModelView::flats
};

// This rank's shard of one flat param: flat elements [shard_offset, shard_offset + shard_numel).
struct FlatShardView {
  // The live fp32 master shard. Writes into it land in the model (call master_written after); a
  // view is short-lived (one save or load).
  ShardTensor master;
  int64_t shard_offset = 0;
  int64_t shard_numel = 0;
  bool requires_grad = true;
  std::string tag;  // "layers.0/0", as in collective errors
  // To call after writing into `master` (a load): refreshes what the model derives from it.
  std::function<void()> master_written;
  // Null, or what a load may call for each range of `master` it wrote, with the fp32 host values
  // it wrote (before master_written): the working copy is cast from them, not read back.
  std::function<void(int64_t begin, const at::Tensor& values)> values_written;
  // Null, or (a frozen param kept in a stored form, viewed for a load) what a load that writes
  // every value of the shard may call instead of writing `master`: stores elements [begin, ...)
  // from `values` (any floating dtype, on the host; begin starts a 64-element block) straight
  // into the stored form (FlatParam::store_values); master_written then only ends the load.
  std::function<void(int64_t begin, const at::Tensor& values)> store_values;
  // Null, or (the same, its stored form NF4 in the disk tier) what stores elements [begin, begin +
  // count) (whole blocks) with `absmax()` (fp32) and their packed codes left in `file` at byte
  // `offset`, read there by each gather (Note [NF4 codes read in place], offload/residency.cpp);
  // false when the stored form cannot (the caller stores the values).
  std::function<bool(int64_t begin, int64_t count, const std::function<at::Tensor()>& absmax,
                     std::shared_ptr<const io::File> file, int64_t offset)>
      store_codes;
  // Null, or (a frozen param kept in a stored form, viewed without its values) what fills `master`
  // with its current values: before writing part of it.
  std::function<void()> read_values;
  size_t index = 0;  // position in the root's flat-param order (units pre-order, then each unit's)
  // Whether this rank writes the shard: replicas of a shard (HSDP, NO_SHARD, parameters kept
  // whole on every rank) hold the same elements, and only the first of them writes.
  bool writer = true;
  // Null, or (a frozen param kept in a stored form, viewed with its values: a save; read_values is
  // set too) what frees the fp32 copy that read_values filled, once written. A save fills and frees one such shard at a
  // time (Note [The load and the save]).
  std::function<void()> drop_values;
};

// A persistent buffer (FullyShardOptions::buffers): replicated, saved whole by the job's rank 0.
struct BufferView {
  std::string name;                   // fully qualified, e.g. "1.running_mean"
  at::Tensor tensor;                  // the live buffer; copies into it land in the model
  at::ScalarType dtype = at::kFloat;  // the dtype checkpoints hold it in
};

struct ModelView {
  std::vector<FlatShardView> flats;        // the root's flat-param order
  std::vector<ShardedTensorView> tensors;  // model registration order, tied tensors once
  std::vector<BufferView> buffers;         // after the parameters in the model file
  Dist* dist = nullptr;                    // the job the model is sharded over
  std::string strategy;                    // the root's sharding strategy, e.g. "FULL_SHARD"
};

// The view of `root` (lazily initialising it first). A frozen flat param kept in a stored form
// (FullyShardOptions::frozen_storage) shows an fp32 copy of its shard, memory that is not filled
// until asked: when `frozen_values` (a save) read_values decodes its values into it and
// drop_values frees them; else it is to be written (a load or an import, which call
// master_written after writing it). It first frees the step's kept gather blocks and free heap.
ModelView model_view(FSDPModule& root, bool frozen_values = true);
// The same for a load that writes whole every parameter `load_writes` names (full names): a lazy
// init it triggers leaves their flat params to it (Note [Deferred init leaves what a load writes]
// in shard/unit_init.cpp). After the load, finish_deferred_init(root) fills from the init what it
// did not write (it failed midway); on success it finds nothing to do.
ModelView model_view(FSDPModule& root, bool frozen_values, const std::function<bool(const std::string&)>& load_writes);
void finish_deferred_init(FSDPModule& root);
// Drops the frozen flat params' tensors and masters from `view`: a checkpoint of the trainable
// parameters only (SaveOptions::frozen_params), or a load of one.
void omit_frozen(ModelView& view);

}  // namespace fsdp
