// FlatLayout: where each parameter of a flat param sits in its flat buffer, and which part of the
// buffer this rank's shard holds. Fixed when the flat param is built (the tag aside, named once
// the root is known); the other parts of a FlatParam (flat_param.h) read it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "fsdp/comm.h"
#include "fsdp/frozen_storage.h"

namespace fsdp {

// One parameter's place in a flat buffer. The layout that checkpoints use.
struct FlatParamEntry {
  std::string name;                  // relative to the unit's module, e.g. "mlp.up_proj.weight"
  std::vector<std::string> aliases;  // other names of the same tensor (tied weights)
  at::Tensor param;                  // the user's parameter (identity preserved)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in the flat (unpadded) buffer
};

struct FlatParamConfig {
  at::ScalarType compute_dtype = at::kFloat;  // dtype of the unsharded buffer (param_dtype)
  at::ScalarType reduce_dtype = at::kFloat;   // dtype gradients are reduced in
  bool requires_grad = true;
  // A frozen flat param's stored form (Note [Frozen storage], kernels/cpu/blocks.cpp): kFloat32 is an
  // fp32 master like a trainable one's; anything else is kept as stored, with no fp32 master.
  FrozenStorage storage = FrozenStorage::kFloat32;
  int group = 0;            // optimizer group
  std::string tag;          // "layers.0/0": shows in collective errors
  std::string module_type;  // the unit's module type, for misuse errors (Note [Guarded parameters])
  // The compute device (the process group's, InitOptions::device): where gathered params and
  // their gradients live, and the master shard unless offloaded. Parameters must already be on
  // it, or on the meta device (deferred init materialises the shard on it).
  c10::Device device = c10::Device(c10::kCPU);
  // FullyShardOptions::replicate_params: whole on every rank (a one-rank shard group), its
  // gradient's all-reduce issued as soon as backward is done with it.
  bool replicated = false;
};

class FlatLayout {
 public:
  // Lays the entries out in order, each quantized parameter (a frozen int8 / NF4 stored form)
  // starting a block, padded so that every rank's shard has the same size (and whole blocks).
  // ConfigError when some parameters are on the meta device and others not, or on another device.
  FlatLayout(std::vector<FlatParamEntry> entries, FlatParamConfig config, Communicator& shard_group,
             Communicator& replicate_group);

  std::vector<FlatParamEntry>& entries() { return entries_; }
  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  const FlatParamConfig& config() const { return config_; }
  void set_tag(std::string tag) { config_.tag = std::move(tag); }
  Communicator& shard_group() const { return shard_group_; }
  Communicator& replicate_group() const { return replicate_group_; }
  bool meta() const { return meta_; }  // built on the meta device: deferred init or a load fills it
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shard_offset() const { return shard_offset_; }  // first flat element of this rank's shard
  // Elements of this rank's shard that hold parameters (the rest is the flat buffer's padding).
  int64_t values_in_shard() const;
  // The unsharded buffer's dtype (compute) on the compute device.
  at::TensorOptions compute_options() const;
  // Zeroes what lies outside every parameter in `values` (this rank's shard): a gap to a
  // parameter's next block, the padding.
  void zero_gaps(const at::Tensor& values) const;

 private:
  std::vector<FlatParamEntry> entries_;
  FlatParamConfig config_;
  Communicator& shard_group_;
  Communicator& replicate_group_;
  bool meta_ = false;
  int64_t numel_ = 0;         // elements of the parameters, gaps before a block's start included
  int64_t padded_numel_ = 0;  // numel_ rounded up to the shard group's size (in whole blocks)
  int64_t shard_numel_ = 0;   // padded_numel_ / the shard group's size
  int64_t shard_offset_ = 0;  // shard_numel_ * this rank's index in the shard group
};

}  // namespace fsdp
