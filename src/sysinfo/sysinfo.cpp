// See sysinfo.h.
#include "sysinfo/sysinfo.h"

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fsdp::sysinfo {
namespace {

std::atomic<int64_t> cleared_peak{0};  // the highest mark reset_peak_rss cleared

int64_t kib_to_bytes(int64_t kib) { return kib < 0 ? -1 : kib * 1024; }

}  // namespace

int64_t keyed_number(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    size_t i = key.size();
    while (i < line.size() && (line[i] == ':' || line[i] == ' ' || line[i] == '\t')) ++i;
    if (i == line.size() || line[i] < '0' || line[i] > '9') continue;
    return std::strtoll(line.c_str() + i, nullptr, 10);  // no exception: LLONG_MAX past its range
  }
  return -1;
}

bool read_text(const std::string& path, std::string* text) {
  std::ifstream in(path);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  *text = buffer.str();
  return true;
}

ProcessMemory process_memory(pid_t pid) {
  std::string status;
  if (!read_text("/proc/" + std::to_string(pid) + "/status", &status)) return {};
  return {kib_to_bytes(keyed_number(status, "VmRSS")), kib_to_bytes(keyed_number(status, "VmHWM"))};
}

int64_t process_rss_bytes() { return std::max<int64_t>(process_memory(::getpid()).rss, 0); }

int64_t peak_rss_bytes() { return std::max<int64_t>(process_memory(::getpid()).peak, 0); }

bool reset_peak_rss() {
  const int64_t mark = peak_rss_bytes();
  int64_t seen = cleared_peak.load();
  while (mark > seen && !cleared_peak.compare_exchange_weak(seen, mark)) {
  }
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool written = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && written;
}

int64_t lifetime_peak_rss_bytes() {
  struct rusage u {};
  const int64_t usage = ::getrusage(RUSAGE_SELF, &u) == 0 ? static_cast<int64_t>(u.ru_maxrss) * 1024 : 0;  // KiB
  return std::max({usage, peak_rss_bytes(), cleared_peak.load()});
}

int64_t heap_in_use_bytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 mi = ::mallinfo2();  // summed over every arena
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
#else
  return 0;
#endif
}

HostMemory host_memory() {
  std::string meminfo;
  if (!read_text("/proc/meminfo", &meminfo)) return {};
  return {kib_to_bytes(keyed_number(meminfo, "MemTotal")), kib_to_bytes(keyed_number(meminfo, "MemAvailable"))};
}

int64_t free_disk_bytes(const std::string& path) {
  std::string p = path.empty() ? "." : path;
  struct statvfs st {};
  while (::statvfs(p.c_str(), &st) != 0) {
    const auto slash = p.find_last_of('/');
    if (p == "/" || p == ".") return -1;
    p = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
  }
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

}  // namespace fsdp::sysinfo
