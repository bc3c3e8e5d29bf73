// See host_malloc.h.
//
// Note [Host malloc settings]
// A training step on the CPU allocates and frees the same buffers step after step: gathered
// parameters, gradients, collective outputs, activations. glibc serves a block above its mmap
// threshold (128 KiB at first, raised dynamically to at most 32 MiB) with a mapping of its own,
// and trims freed memory at the heap's top beyond its trim threshold; either way the next step's
// allocation faults in and zeroes fresh pages. On a communication-bound model on 2 ranks of this
// repository's benchmark (bench/results/compare.md) that kernel work was about a quarter of the
// step. Fixed thresholds keep blocks below 4 MiB in the heap for reuse, and the flat buffers, the
// largest and most frequent, are reused whatever their size (Note [Reusing freed host buffers]).
// The mmap threshold stays at 4 MiB, not glibc's 32 MiB ceiling: blocks between the two, kept in
// the heap, fragment it. Training a 0.5B-parameter model on 2 ranks that way, each rank's heap
// held 2 GiB free at the end of backward and its peak RSS was 1.4x what its buffers needed
// (bench/results/scale-qwen2.5-0.5b.md); at 4 MiB it holds about 0.4 GiB, and the step times of
// bench/ab_step_time.py stay within their spread (0.96x both configs). Memory freed after the
// peak returns to the system only in the part above 512 MiB at the heap's top.
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
    constexpr int kMmapThreshold = 4 << 20;
    constexpr int kTrimThreshold = 512 << 20;
    tuned = ::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#endif
  });
  return tuned;
}

void return_free_heap() {
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}

}  // namespace fsdp::base
