// What the system reports of memory and disk (src/sysinfo): the /proc parser on sample text, and
// each reading on this machine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "sysinfo/sysinfo.h"

namespace {

using namespace fsdp::sysinfo;

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(SysInfo, KeyedNumberReadsProcLinesByKey) {
  const std::string status = "Name:\tfsdp-train\nVmPeak:\t  9000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n";
  EXPECT_EQ(keyed_number(status, "VmRSS"), 1024);
  EXPECT_EQ(keyed_number(status, "VmHWM"), 2048);
  EXPECT_EQ(keyed_number(status, "VmSwap"), -1);  // absent
  EXPECT_EQ(keyed_number(status, "Name"), -1);    // not a number
  // cgroup v1's memory.oom_control: a longer key that starts with the key is not it.
  EXPECT_EQ(keyed_number("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", "oom_kill"), 3);
  EXPECT_EQ(keyed_number("low 0\noom_kill 3\n", "oom_kill"), 3);
  EXPECT_EQ(keyed_number("MemTotal:       24576000 kB\nMemAvailable:   12000000 kB\n", "MemAvailable"), 12000000);
  EXPECT_EQ(keyed_number(" VmRSS: 5 kB\n", "VmRSS"), -1);  // a key is at the start of its line
  EXPECT_EQ(keyed_number("", "VmRSS"), -1);
}

TEST(SysInfo, ProcessMemoryOfThisProcessAndOfNone) {
  const ProcessMemory self = process_memory(::getpid());
  EXPECT_GT(self.rss, 0);
  EXPECT_GE(self.peak, self.rss);
  EXPECT_GT(process_rss_bytes(), 0);
  const ProcessMemory none = process_memory(-1);  // no /proc/-1
  EXPECT_EQ(none.rss, -1);
  EXPECT_EQ(none.peak, -1);
}

TEST(SysInfo, PeakFollowsTouchedMemoryAndLifetimePeakSurvivesReset) {
  const int64_t before = process_rss_bytes();
  {
    const size_t bytes = static_cast<size_t>(64 * kMiB);
    std::unique_ptr<char, decltype(&std::free)> block(static_cast<char*>(std::malloc(bytes)), &std::free);
    ASSERT_NE(block, nullptr);
    std::memset(block.get(), 1, bytes);
    EXPECT_GE(peak_rss_bytes(), before + 60 * kMiB);
  }
  const int64_t peak = peak_rss_bytes();
  if (!reset_peak_rss()) GTEST_SKIP() << "this kernel does not let /proc/self/clear_refs reset the peak";
  EXPECT_LT(peak_rss_bytes(), peak);           // the 64 MiB block is unmapped: the mark came down
  EXPECT_GE(lifetime_peak_rss_bytes(), peak);  // and is kept as the process's peak
}

TEST(SysInfo, HeapInUseCountsAnAllocation) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const int64_t before = heap_in_use_bytes();
  void* block = std::malloc(static_cast<size_t>(32 * kMiB));
  ASSERT_NE(block, nullptr);
  EXPECT_GE(heap_in_use_bytes(), before + 32 * kMiB);
  std::free(block);
  EXPECT_LT(heap_in_use_bytes(), before + 32 * kMiB);
#else
  EXPECT_EQ(heap_in_use_bytes(), 0);
#endif
}

TEST(SysInfo, HostMemoryAndFreeDisk) {
  const HostMemory host = host_memory();
  EXPECT_GT(host.total, 0);
  EXPECT_GT(host.available, 0);
  EXPECT_LE(host.available, host.total);
  EXPECT_GT(free_disk_bytes("/"), 0);
  EXPECT_GT(free_disk_bytes("/no/such/folder/of/fsdp"), 0);    // its nearest existing parent, "/"
  EXPECT_GT(free_disk_bytes("no-such-relative-folder/x"), 0);  // the working directory's
  EXPECT_GT(free_disk_bytes(""), 0);
}

}  // namespace
