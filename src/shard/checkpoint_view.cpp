// See checkpoint_view.h.
#include "shard/checkpoint_view.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "buffers/buffer_storage.h"
#include "offload/tier_tensors.h"
#include "flat/flat_param.h"
#include "offload/residency.h"
#include "shard/sharded_unit.h"

namespace fsdp {

void ShardTensor::done(int64_t begin, int64_t end) const {
  if (t_.defined() && t_.is_cpu()) offload::release(t_, begin, end);
}

ShardTensor ShardTensor::snapshot() const { return ShardTensor(offload::clone_in_tier(t_)); }

ShardTensor ShardTensor::zeros_like(const std::string& what) const {
  return ShardTensor(offload::zeros_in_tier(t_, what));
}

void ShardTensor::copy_from(const ShardTensor& src) const { offload::copy_streamed(t_, src.t_); }

void ShardTensor::read(int64_t begin, int64_t end,
                       const std::function<void(const float* data, int64_t at, int64_t count)>& fn,
                       const std::string& what) const {
  if (t_.is_cpu() && t_.scalar_type() == at::kFloat) {
    offload::read_streamed(t_, begin, end, what, fn);
    return;
  }
  // A device state, or one kept in bf16 (AdamW's moments): fp32 copies in host memory.
  constexpr int64_t kDeviceChunk = 16 << 20;  // elements per copy to the host (64 MiB)
  for (int64_t a = begin; a < end; a += kDeviceChunk) {
    const int64_t n = std::min(end - a, kDeviceChunk);
    const at::Tensor host = t_.narrow(0, a, n).to(at::kCPU).to(at::kFloat).contiguous();
    fn(host.data_ptr<float>(), a, n);
  }
}

bool ShardTensor::in_file() const { return t_.defined() && offload::is_disk_backed(t_); }

ShardTensor::Writer::Writer(const ShardTensor& dst, const std::string& what)
    : w_(std::make_unique<offload::RangeWriter>(dst.values(), what)) {}
ShardTensor::Writer::~Writer() = default;
void ShardTensor::Writer::put(int64_t begin, const at::Tensor& src) { w_->put(begin, src); }
void ShardTensor::Writer::make_room() { w_->make_room(); }
void ShardTensor::Writer::finish() { w_->finish(); }

namespace {

// A frozen param kept in a stored form (Note [Frozen storage]) shows the checkpoint fp32 values in
// fresh memory, its pages untouched until written: a save decodes the shard into it (read_values)
// just before writing it and frees it after (drop_values), so that one such copy exists at a time;
// a load writes it, and master_written stores the values again and lets the fp32 copy go.
FlatShardView view_of(FlatParam* flat, const at::Tensor& master, size_t index) {
  FlatShardView v;
  v.master = ShardTensor(master);
  v.shard_offset = flat->shard_offset();
  v.shard_numel = flat->shard_numel();
  v.requires_grad = flat->config().requires_grad;
  v.tag = flat->config().tag;
  v.index = index;
  v.writer = flat->replicate_group().rank() == 0;
  return v;
}

FlatShardView stored_view(FlatParam* flat, size_t index, bool values) {
  at::Tensor fp32 =
      at::empty({flat->shard_numel()}, at::TensorOptions().dtype(at::kFloat).device(flat->config().device));
  auto release = [flat, fp32] {
    if (flat->values_stored()) {
      flat->end_store_values();
    } else {
      flat->store_frozen(fp32);
    }
    fp32.storage().unsafeGetStorageImpl()->reset();
  };
  FlatShardView v = view_of(flat, fp32, index);
  v.master_written = release;
  v.read_values = [flat, fp32] { flat->frozen_values_into(fp32); };
  if (values) v.drop_values = [fp32] { fp32.storage().unsafeGetStorageImpl()->reset(); };
  if (!values) v.store_values = [flat](int64_t begin, const at::Tensor& part) { flat->store_values(begin, part); };
  if (!values) {
    v.store_codes = [flat](int64_t begin, int64_t count, const std::function<at::Tensor()>& absmax,
                           std::shared_ptr<const io::File> file, int64_t offset) {
      return flat->store_codes_in_place(begin, count, {absmax, std::move(file), offset});
    };
  }
  return v;
}

}  // namespace

void omit_frozen(ModelView& view) {
  std::vector<ShardedTensorView> kept;
  for (auto& t : view.tensors) {
    if (view.flats[t.flat].requires_grad) kept.push_back(std::move(t));
  }
  view.tensors = std::move(kept);
  for (auto& f : view.flats) {
    if (f.requires_grad) continue;
    f.master = ShardTensor();
    f.master_written = nullptr;
  }
}

ModelView model_view(FSDPModule& root, bool frozen_values) { return model_view(root, frozen_values, nullptr); }

void finish_deferred_init(FSDPModule& root) {
  if (ShardedUnit& u = unit_of(root); u.root() == &u) u.finish_deferred_init();
}

ModelView model_view(FSDPModule& root, bool frozen_values, const std::function<bool(const std::string&)>& load_writes) {
  ModelView view;
  if (ShardedUnit& u = unit_of(root); u.root() == nullptr) u.lazy_init(load_writes);
  // The optimizer's last writes may still be draining into the disk tier (Note [The disk tier
  // around the step after backward] in optim/optim.cpp): what is saved, loaded or exported
  // through this view waits for them.
  if (ShardedUnit& u = unit_of(root); u.root() != nullptr && u.root_state().disk_tier)
    u.root_state().disk_tier->flush();
  buffers::release_freed_host_blocks();  // not beside a save's or a load's memory
  // Tensor identity -> (flat index, entry, the unit's prefix). Units pre-order, then each unit's
  // flat params: the order the optimizer's states and the saved files follow.
  struct Placed {
    size_t flat;
    const FlatParamEntry* entry;
    std::string prefix;
  };
  std::unordered_map<const void*, Placed> by_tensor;
  for (ShardedUnit* unit : units_of(root)) {
    for (auto& fp : unit->flat_params()) {
      const size_t index = view.flats.size();
      FlatParam* flat = fp.get();
      if (fp->stores_frozen()) {
        view.flats.push_back(stored_view(flat, index, frozen_values));
      } else {
        FlatShardView v = view_of(flat, fp->sharded_param(), index);
        v.master_written = [flat] { flat->master_written(); };
        v.values_written = [flat](int64_t begin, const at::Tensor& values) { flat->values_written(begin, values); };
        view.flats.push_back(std::move(v));
      }
      for (const auto& e : fp->entries()) by_tensor[e.param.unsafeGetTensorImpl()] = {index, &e, unit->prefix()};
    }
  }
  // The model's own registration order gives files that read like the model.
  auto module = unit_of(root).module().lock();
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    auto it = by_tensor.find(item.value().unsafeGetTensorImpl());
    if (it == by_tensor.end()) continue;
    const Placed& p = it->second;
    ShardedTensorView t;
    t.name = p.prefix + p.entry->name;
    for (const auto& alias : p.entry->aliases) t.aliases.push_back(p.prefix + alias);
    t.shape = p.entry->shape;
    t.numel = p.entry->numel;
    t.offset = p.entry->offset;
    t.flat = p.flat;
    view.tensors.push_back(std::move(t));
    by_tensor.erase(it);  // tied: once
  }
  for (const auto& b : unit_of(root).root_state().buffers) view.buffers.push_back({b.name, b.tensor, b.saved_dtype});
  view.dist = &unit_of(root).mesh().dist();
  view.strategy = strategy_name(unit_of(root).options().strategy);
  return view;
}

}  // namespace fsdp
