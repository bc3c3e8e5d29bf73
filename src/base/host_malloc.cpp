// See host_malloc.h.
//
// Note [Host malloc settings]
// A training step on the CPU allocates and frees the same buffers step after step: gathered
// parameters, gradients, collective outputs, activations. glibc serves a block above its mmap
// threshold (128 KiB at first, raised dynamically to at most 32 MiB) with a mapping of its own,
// and trims freed memory at the heap's top beyond its trim threshold; either way the next step's
// allocation faults in and zeroes fresh pages. On a communication-bound model on 2 ranks of this
// repository's benchmark (bench/results/compare.md) that kernel work was about a quarter of the
// step. Fixed thresholds keep such blocks in the heap for reuse. What is kept is memory the
// process held at its peak anyway, so the peak RSS does not change; memory freed after the peak
// returns to the system only in the part above 512 MiB at the heap's top.
#include "base/host_malloc.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fsdp::base {
namespace {

bool user_chose_malloc_settings() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "malloc") != nullptr) return true;
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) return true;
  const char* opt = std::getenv("FSDP_HOST_MALLOC_TUNING");
  return opt != nullptr && std::string(opt) == "0";
}

}  // namespace

bool tune_host_malloc() {
  static std::once_flag once;
  static bool tuned = false;
  std::call_once(once, [] {
#if defined(__GLIBC__)
    if (user_chose_malloc_settings()) return;
    constexpr int kMmapThreshold = 32 << 20;  // glibc's largest dynamic threshold on 64-bit
    constexpr int kTrimThreshold = 512 << 20;
    tuned = ::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#endif
  });
  return tuned;
}

}  // namespace fsdp::base
