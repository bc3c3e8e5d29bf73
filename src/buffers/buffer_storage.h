// A buffer's memory, freed and grown back without touching its sizes, so that views of it (a flat
// param's parameters and gradients, what autograd saved) stay valid: how the shard layer's
// gathered buffers come and go (Note [Flat buffer lifetime] in shard/flat_param.h).
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::buffers {

// Frees (alive false) or allocates (true) `t`'s whole storage. On the CPU a freed block is kept
// for the next buffer of its size (Note [Reusing freed host buffers] in buffer_storage.cpp).
void set_storage_alive(const at::Tensor& t, bool alive);
// Frees the blocks kept for reuse and returns the heap's free memory: before a phase that gathers
// nothing and holds memory of its own (a checkpoint's save or load), whose peak they would add to.
void release_freed_host_blocks();

}  // namespace fsdp::buffers
