// Building a model of stock LibTorch modules without allocating it.
//
// torch::nn::Linear, Embedding, LayerNorm, Conv and the rest allocate their parameters on the CPU
// in their constructors, and a module on the CPU cannot be moved to the meta device afterwards.
// Inside a MetaDeviceGuard every tensor a factory function creates (torch::empty, zeros, randn,
// the modules' own init) is a meta tensor: sizes and dtype, no bytes. So the model is built as
// it is, whole, without memory:
//
//   std::shared_ptr<MyModelImpl> model;
//   { fsdp::MetaDeviceGuard meta; model = std::make_shared<MyModelImpl>(cfg); }
//   auto shape = fsdp::model_shape(*model, is_block);       // plan it: nothing allocated
//   auto opts = fsdp::FullyShardOptions().init(my_init);     // each rank materialises its shard
//   for (auto& block : model->blocks) fsdp::fully_shard(block, mesh, opts);
//   auto root = fsdp::fully_shard(model, mesh, opts);
//
// Parameters are materialised shard by shard by FullyShardOptions::init (or loaded from a
// checkpoint); meta buffers (BatchNorm's running statistics) are materialised whole on every rank
// at the root's first forward, by the same function under their names relative to the root.
// Tensors built from values (a 0-d counter such as BatchNorm's num_batches_tracked) stay real:
// they already hold their value. The guard is per thread and ends with its scope; nothing in it
// may read a tensor's values.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace fsdp {

class MetaDeviceGuard {
 public:
  MetaDeviceGuard() = default;
  MetaDeviceGuard(const MetaDeviceGuard&) = delete;
  MetaDeviceGuard& operator=(const MetaDeviceGuard&) = delete;

 private:
  // A factory function carries no tensor to dispatch on: BackendSelect picks the kernel from
  // its options (the CPU). Without BackendSelect, the dispatch key set is what the thread
  // includes: the meta kernels, which allocate nothing. The thread's whole key set is restored
  // at the end, exactly (removing the Meta key alone would leave its backend bit behind).
  c10::impl::ForceDispatchKeyGuard keys_{
      c10::impl::tls_local_dispatch_key_set().included_ | c10::DispatchKeySet(c10::DispatchKey::Meta),
      c10::impl::tls_local_dispatch_key_set().excluded_ | c10::DispatchKeySet(c10::DispatchKey::BackendSelect)};
};

}  // namespace fsdp
