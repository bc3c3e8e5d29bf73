// Freed host buffers kept for reuse (Note [Reusing freed host buffers], src/offload/buffer_storage.cpp):
// a block of a mapping's size goes to the next buffer of its size, even when small buffers were
// freed between (a LoRA unit frees its frozen base's block, then its adapters' and its norms'); small
// blocks go back to the heap; release_freed_host_blocks lets the kept ones go.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "base/host_malloc.h"
#include "offload/buffer_storage.h"

namespace fsdp::offload {
namespace {

at::Tensor buffer(int64_t bytes) { return at::empty({bytes}, at::kByte); }

TEST(BufferStorage, LargeBlockSurvivesSmallFreesAndIsReused) {
  release_freed_host_blocks();
  const int64_t big = 3 * base::kHostMmapThreshold, small = base::kHostMmapThreshold / 4;
  at::Tensor a = buffer(big), b = buffer(small), c = buffer(small / 64), d = buffer(big);
  const void* a_block = a.data_ptr();
  // One unit's three buffers freed: the large block first, then two small ones.
  set_storage_alive(a, false);
  set_storage_alive(b, false);
  set_storage_alive(c, false);
  EXPECT_EQ(a.storage().nbytes(), 0u);
  EXPECT_EQ(a.numel(), big) << "sizes stay, so views stay valid";
  // The next unit's buffer of the same size takes the kept block.
  set_storage_alive(d, false);
  set_storage_alive(d, true);
  EXPECT_EQ(d.data_ptr(), a_block) << "the large block was pushed out by the small ones";
  set_storage_alive(a, true);
  EXPECT_EQ(a.storage().nbytes(), static_cast<size_t>(big));
  a.fill_(7);
  EXPECT_EQ(a[big - 1].item<int>(), 7);
  set_storage_alive(b, true);  // small: from the heap, whole
  EXPECT_EQ(b.storage().nbytes(), static_cast<size_t>(small));
  // Once released, a freed block is not handed out again.
  set_storage_alive(d, false);
  release_freed_host_blocks();
  at::Tensor e = buffer(big);
  set_storage_alive(e, false);
  set_storage_alive(e, true);
  EXPECT_EQ(e.storage().nbytes(), static_cast<size_t>(big));
}

}  // namespace
}  // namespace fsdp::offload
