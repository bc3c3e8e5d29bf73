// DeviceMesh: how ranks are arranged for sharding. 1-D: parameters are sharded over all ranks.
// 2-D (replicate x shard), for hybrid sharding: rank = replicate_index * shard_size + shard_index;
// parameters are sharded within a row of `shard_size` ranks and replicated across rows.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/dist.h"

namespace fsdp {

class DeviceMesh {
 public:
  // 1-D mesh over every rank.
  explicit DeviceMesh(std::shared_ptr<Dist> dist);
  // 2-D mesh; replicate_size * shard_size must equal the world size.
  DeviceMesh(std::shared_ptr<Dist> dist, int replicate_size, int shard_size);

  bool is_hybrid() const { return replicate_size_ > 1 && shard_size_ < dist_->world_size(); }
  int shard_rank() const { return shard_rank_; }
  int shard_size() const { return shard_size_; }
  int replicate_rank() const { return replicate_rank_; }
  int replicate_size() const { return replicate_size_; }

  Dist& dist() const { return *dist_; }
  // The ranks a parameter is sharded over.
  Communicator& shard_group() const { return *shard_group_; }
  // The ranks holding the same shard (size 1 on a 1-D mesh).
  Communicator& replicate_group() const { return *replicate_group_; }
  // The `size` consecutive ranks of this rank's shard group that it belongs to (`size` divides
  // shard_size()): where a unit resharded to a group gathers in backward
  // (FullyShardOptions::reshard_after_forward_group). Made on first use, which every rank of the
  // job must reach at the same point (fully_shard does); copies of a mesh share it.
  Communicator& shard_subgroup(int size) const;
  // Every rank of the job, on a communicator of its own: the all-reduce of parameters kept whole
  // on every rank (FullyShardOptions::replicate_params), which must not queue behind gathers.
  // Made on first use, as shard_subgroup.
  Communicator& replicated_params_group() const;
  // The groups of the two above made so far (for counting their traffic).
  std::vector<Communicator*> groups_made_on_use() const;

 private:
  std::shared_ptr<Communicator> lazy_group(const std::string& name, const std::vector<int>& ranks) const;
  std::shared_ptr<Dist> dist_;
  int replicate_size_ = 1;
  int shard_size_ = 1;
  int replicate_rank_ = 0;
  int shard_rank_ = 0;
  std::shared_ptr<Communicator> shard_group_;
  std::shared_ptr<Communicator> replicate_group_;
  // The groups made on first use, by name; shared by copies.
  std::shared_ptr<std::map<std::string, std::shared_ptr<Communicator>>> lazy_groups_ =
      std::make_shared<std::map<std::string, std::shared_ptr<Communicator>>>();
};

}  // namespace fsdp
