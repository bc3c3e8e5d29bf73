// set_storage_alive: a buffer's memory freed and grown back with its views intact.
#include "buffers/buffer_storage.h"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/core/DeviceGuard.h>

#include <deque>
#include <mutex>
#include <vector>

#include "base/host_malloc.h"
#include "fsdp/errors.h"

namespace fsdp::buffers {
namespace {

// Note [Reusing freed host buffers]
// On the CPU a gathered buffer of a few megabytes is its own mapping: freeing it unmaps its pages
// and the next gather's allocation faults in and zeroes new ones. On a communication-bound model
// on 2 ranks that kernel work was about a quarter of the step. A freed block is kept instead
// and handed to the next buffer of the same size from the same allocator, which in a model of
// repeated blocks is the next unit's gather or gradient. At most kKeptBlocks are kept, the most
// recently freed, so the process holds at most that many blocks beyond what is alive: 3, a LoRA
// layer's flat params (its adapters, its NF4 base, its bf16 norms), each freed after the unit's
// forward and taken by the next unit's gather. A kept block is freed once a block freed after it
// is taken, or at an allocation of another size that finds none of its own: the cycle it was kept
// for has ended. (Freeing every block of another size at any allocation, as before, freed a LoRA
// layer's decoded base at its adapters' gather: at Llama-3.1-8B QLoRA each gather then faulted in
// 436 MiB of new pages, 41% of a step in the kernel.) Kept until pushed out, blocks waited beside what the plan counts:
// a split root's frozen embedding, freed after its forward, stayed through every layer's forward (1 GiB in bf16 at
// Llama-3.1-8B: the forward's peak), and a layer's freed gather beside the head's, in fp32 at 8B 0.8 GiB over the plan.
class FreedBlocks {
 public:
  static constexpr size_t kKeptBlocks = 3;

  at::DataPtr take(c10::Allocator* allocator, size_t bytes) {
    std::vector<at::DataPtr> dropped;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    at::DataPtr out(nullptr, at::Device(at::kCPU));
    // The most recently freed block of this size, if any; every block of another size freed
    // before it (all of them when there is none) has outlived its cycle and is freed.
    size_t found = blocks_.size();
    for (size_t i = blocks_.size(); i-- > 0;) {
      if (blocks_[i].allocator == allocator && blocks_[i].bytes == bytes) {
        found = i;
        break;
      }
    }
    const size_t limit = found == blocks_.size() ? blocks_.size() : found;
    std::deque<Block> kept;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& b = blocks_[i];
      if (i == found) {
        out = std::move(b.data);
      } else if (b.allocator == allocator && b.bytes != bytes && i < limit) {
        dropped.push_back(std::move(b.data));  // another allocator's block (pinned beside pageable): kept
      } else {
        kept.push_back(std::move(b));
      }
    }
    blocks_.swap(kept);
    return out;
  }

  void release() {
    std::deque<Block> dropped;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(blocks_);
  }

  void keep(c10::Allocator* allocator, size_t bytes, at::DataPtr data) {
    at::DataPtr dropped(nullptr, at::Device(at::kCPU));  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back({allocator, bytes, std::move(data)});
    if (blocks_.size() > kKeptBlocks) {
      dropped = std::move(blocks_.front().data);
      blocks_.pop_front();
    }
  }

 private:
  struct Block {
    c10::Allocator* allocator;
    size_t bytes;
    at::DataPtr data;
  };
  std::mutex mu_;
  std::deque<Block> blocks_;
};

FreedBlocks& freed_host_blocks() {
  static FreedBlocks* blocks = new FreedBlocks();  // never destroyed: storages may outlive statics
  return *blocks;
}

// Grows or frees a buffer's memory without touching its sizes, so views of it stay valid.
// See Note [Freeing device buffers] and Note [Reusing freed host buffers].
}  // namespace

void release_freed_host_blocks() {
  freed_host_blocks().release();
  base::return_free_heap();
}

void set_storage_alive(const at::Tensor& t, bool alive) {
  const size_t bytes = alive ? static_cast<size_t>(t.numel()) * t.element_size() : 0;
  if (t.storage().nbytes() == bytes) return;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (t.device().is_cpu()) {
    c10::Allocator* allocator = storage->allocator();
    if (allocator == nullptr || !storage->resizable()) {
      at::native::resize_bytes_cpu(storage, bytes);
      return;
    }
    // Whole buffers only: freed whole, and refilled whole by the next gather or zero_.
    const size_t old_bytes = storage->nbytes();
    if (bytes == 0) {
      at::DataPtr old = storage->set_data_ptr(at::DataPtr(nullptr, t.device()));
      storage->set_nbytes(0);
      if (old.get() != nullptr) freed_host_blocks().keep(allocator, old_bytes, std::move(old));
      return;
    }
    at::DataPtr fresh = old_bytes == 0 ? freed_host_blocks().take(allocator, bytes) : at::DataPtr(nullptr, t.device());
    if (fresh.get() == nullptr) {
      at::native::resize_bytes_cpu(storage, bytes);
      return;
    }
    storage->set_data_ptr_noswap(std::move(fresh));
    storage->set_nbytes(bytes);
    return;
  }
  // Note [Freeing device buffers]
  // On a device the old bytes are never wanted (a buffer is freed whole and refilled whole by
  // the next all-gather or zero_), so the storage gets a fresh allocation from its own allocator
  // (the CUDA caching allocator, which allocates on the current device: hence the guard) instead
  // of resize's allocate-copy-free. Dropping the old DataPtr returns its block to the pool of the
  // stream it was allocated on, the compute stream. That is safe because callers free only after
  // CommHandle::wait, which orders the waiting thread's stream after the collective (Note
  // [Collectives on the caller's stream]) and returns once the collective has completed.
  c10::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) {
    throw ConfigError("fsdp: cannot free a flat buffer on " + t.device().str() + ": its storage has no allocator");
  }
  const c10::DeviceGuard on_device(t.device());
  storage->set_data_ptr_noswap(bytes == 0 ? at::DataPtr(nullptr, t.device()) : allocator->allocate(bytes));
  storage->set_nbytes(bytes);
}

}  // namespace fsdp::buffers
