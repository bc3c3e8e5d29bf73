// The host allocator's settings for a training process. See Note [Host malloc settings].
#pragma once

namespace fsdp::base {

// Once per process, before its first collective: with glibc, allocations below 4 MiB come from
// the heap instead of mappings of their own, and freed heap memory is returned to the system
// only beyond 512 MiB at its top. Skipped when the user chose malloc settings already
// (GLIBC_TUNABLES naming malloc, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) or set
// FSDP_HOST_MALLOC_TUNING=0. Returns whether it changed them (this call or an earlier one).
bool tune_host_malloc();
// Returns the heap's free memory to the system (glibc's malloc_trim): what a training step freed
// and the heap kept, before a phase that holds memory of its own (a checkpoint's save or load).
void return_free_heap();

}  // namespace fsdp::base
