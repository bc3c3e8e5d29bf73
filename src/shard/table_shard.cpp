// See shard/table_shard.h.
#include "shard/table_shard.h"

#include "fsdp/errors.h"
#include "flat/flat_param.h"
#include "shard/sharded_unit.h"

namespace fsdp {

std::optional<TableShard> TableShard::of(const torch::nn::Module& module, const char* fn) {
  ShardedUnit* unit = detail::unit_of(module);
  if (unit == nullptr) return std::nullopt;
  if (!unit->options().vocab_parallel) {
    throw UsageError(std::string("fsdp::") + fn + ": module '" + unit->path_before_root() +
                     "' is sharded without FullyShardOptions::vocab_parallel: run it through fsdp::call, or "
                     "shard it with vocab_parallel(true)");
  }
  if (unit->root() == nullptr) {
    throw UsageError(std::string("fsdp::") + fn + ": vocab-parallel table '" + unit->path_before_root() +
                     "' used before its root's lazy init: call it inside the forward the root runs through "
                     "fsdp::call");
  }
  if (unit->root_state().joined) {
    throw UsageError(std::string("fsdp::") + fn + ": vocab-parallel table '" + unit->name() +
                     "' inside an fsdp::Join: a rank that has finished takes no part in its collectives; "
                     "gather the table instead (shard it without vocab_parallel)");
  }
  return TableShard(unit->shared_from_this(), unit->flat_params()[0].get());
}

Communicator& TableShard::group() const { return fp_->shard_group(); }
const std::string& TableShard::tag() const { return fp_->config().tag; }
at::ScalarType TableShard::compute_dtype() const { return fp_->config().compute_dtype; }
c10::Device TableShard::device() const { return fp_->config().device; }
const std::vector<int64_t>& TableShard::shape() const { return fp_->entries()[0].shape; }
int64_t TableShard::offset() const { return fp_->entries()[0].offset; }
int64_t TableShard::shard_numel() const { return fp_->shard_numel(); }
int64_t TableShard::shard_offset() const { return fp_->shard_offset(); }
void TableShard::with_values(const std::function<void(const at::Tensor&)>& fn) const { fp_->with_shard_values(fn); }

}  // namespace fsdp
