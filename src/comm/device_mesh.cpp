// DeviceMesh construction: the shard and replicate groups of a 1-D or 2-D mesh.
#include "fsdp/device_mesh.h"

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator_impl.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace {

// The world communicator, shared without taking ownership (the Dist owns it).
std::shared_ptr<Communicator> borrow_world(const std::shared_ptr<Dist>& dist) {
  return std::shared_ptr<Communicator>(dist, &dist->world());
}

// A mesh dimension of size 1: this rank alone.
std::shared_ptr<Communicator> self_group(int global_rank, const std::string& name, const InitOptions& options) {
  return make_local_group(name, global_rank, options.timeout());
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<Dist> dist) : dist_(std::move(dist)) {
  if (!dist_) throw ConfigError("fsdp: DeviceMesh needs a Dist (fsdp::init_from_env())");
  shard_size_ = dist_->world_size();
  shard_rank_ = dist_->rank();
  shard_group_ = borrow_world(dist_);
  replicate_group_ = self_group(dist_->rank(), "replicate/" + std::to_string(dist_->rank()), dist_->options());
}

DeviceMesh::DeviceMesh(std::shared_ptr<Dist> dist, int replicate_size, int shard_size)
    : dist_(std::move(dist)), replicate_size_(replicate_size), shard_size_(shard_size) {
  if (!dist_) throw ConfigError("fsdp: DeviceMesh needs a Dist (fsdp::init_from_env())");
  const int world = dist_->world_size();
  if (replicate_size > world || (replicate_size >= 1 && world % replicate_size != 0)) {
    throw ConfigError("fsdp: DeviceMesh: replicate_size=" + std::to_string(replicate_size) +
                      ": must divide the world size " + std::to_string(world));
  }
  if (replicate_size < 1 || shard_size < 1 || replicate_size * shard_size != world) {
    throw ConfigError("fsdp: DeviceMesh(replicate_size=" + std::to_string(replicate_size) + ", shard_size=" +
                      std::to_string(shard_size) + "): the product must equal the world size " + std::to_string(world));
  }
  const int rank = dist_->rank();
  replicate_rank_ = rank / shard_size;
  shard_rank_ = rank % shard_size;
  // Every rank creates only the groups it belongs to; names are the same on all members.
  if (shard_size == world) {
    shard_group_ = borrow_world(dist_);
  } else {
    std::vector<int> row;
    for (int s = 0; s < shard_size; ++s) row.push_back(replicate_rank_ * shard_size + s);
    shard_group_ = shard_size == 1 ? self_group(rank, "shard/" + std::to_string(replicate_rank_), dist_->options())
                                   : dist_->new_group(row, "shard/" + std::to_string(replicate_rank_));
  }
  if (replicate_size == world) {
    replicate_group_ = borrow_world(dist_);
  } else {
    std::vector<int> column;
    for (int r = 0; r < replicate_size; ++r) column.push_back(r * shard_size + shard_rank_);
    replicate_group_ = replicate_size == 1
                           ? self_group(rank, "replicate/" + std::to_string(shard_rank_), dist_->options())
                           : dist_->new_group(column, "replicate/" + std::to_string(shard_rank_));
  }
}

std::shared_ptr<Communicator> DeviceMesh::lazy_group(const std::string& name, const std::vector<int>& ranks) const {
  auto it = lazy_groups_->find(name);
  if (it != lazy_groups_->end()) return it->second;
  auto group = ranks.size() == 1 ? self_group(dist_->rank(), name, dist_->options()) : dist_->new_group(ranks, name);
  lazy_groups_->emplace(name, group);
  return group;
}

Communicator& DeviceMesh::shard_subgroup(int size) const {
  if (size < 1 || shard_size_ % size != 0) {
    throw ConfigError("fsdp: a group of " + std::to_string(size) + " ranks does not divide the shard group of " +
                      std::to_string(shard_size_) + " ranks: give a divisor of it (e.g. the ranks of one node)");
  }
  const int first = replicate_rank_ * shard_size_ + (shard_rank_ / size) * size;
  std::vector<int> ranks;
  for (int i = 0; i < size; ++i) ranks.push_back(first + i);
  return *lazy_group("shard_by" + std::to_string(size) + "/" + std::to_string(first), ranks);
}

std::vector<Communicator*> DeviceMesh::groups_made_on_use() const {
  std::vector<Communicator*> out;
  for (const auto& [name, group] : *lazy_groups_) out.push_back(group.get());
  return out;
}

Communicator& DeviceMesh::replicated_params_group() const {
  std::vector<int> all;
  for (int r = 0; r < dist_->world_size(); ++r) all.push_back(r);
  return *lazy_group("replicated_params", all);
}

}  // namespace fsdp
