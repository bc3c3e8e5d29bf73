// offload/testing.h's switches: test hooks (tier_hooks.h) on the disk tier.
#include "offload/testing.h"

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <mutex>

#include "offload/disk_tier.h"
#include "offload/tier_hooks.h"

namespace fsdp::offload {
namespace {

// mmap fails with ENODEV, as on a file system without mmap support.
struct NoMmap final : TierHooks {
  void* map_shared(int /*fd*/, size_t /*bytes*/) const override {
    errno = ENODEV;
    return MAP_FAILED;
  }
};

// Keeps the most of the tier's resident pages and budgeted buffers seen at its audit points.
struct Audit final : TierHooks {
  std::atomic<int64_t> peak{0};  // audited on the optimizer's thread too
  void audit(const FileTier& tier) override {
    const int64_t r = tier.resident_bytes() + tier.buffered_bytes();
    int64_t seen = peak.load();
    while (r > seen && !peak.compare_exchange_weak(seen, r)) {
    }
  }
  int64_t peak_resident_bytes() const override { return peak.load(); }
};

std::mutex g_mu;
std::shared_ptr<TierHooks> g_new_tiers;  // null: the product's

}  // namespace

std::shared_ptr<TierHooks> hooks_for_new_tiers() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_new_tiers ? g_new_tiers : std::make_shared<TierHooks>();
}

namespace testing {
void fail_mmap(bool on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_new_tiers = on ? std::make_shared<NoMmap>() : nullptr;
}
void set_audit(DiskTier& tier, bool on) {
  static_cast<FileTier&>(tier).set_hooks(on ? std::make_shared<Audit>() : std::make_shared<TierHooks>());
}
void drop_page_cache(DiskTier& tier) { static_cast<FileTier&>(tier).drop_page_cache(); }
}  // namespace testing

}  // namespace fsdp::offload
