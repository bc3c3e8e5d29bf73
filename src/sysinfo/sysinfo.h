// What the operating system reports about this machine's and a process's memory and disk (Linux:
// /proc, statvfs, glibc's mallinfo2), one function per reading. Plain C++ and POSIX: no LibTorch,
// no other layer, so the launcher (apps/fsdp-run) uses it as the library and the trainer do.
// A reading the system does not offer is a stated fallback (-1, or 0 where noted), never an
// exception: each caller decides whether a missing figure is an error.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace fsdp::sysinfo {

// ---- parsing (pure: tests feed it sample /proc text) --------------------------------------------

// The number of the first line of `text` that starts with `key` followed by ':' or blanks and a
// number: "VmRSS:   1234 kB" (/proc/PID/status, /proc/meminfo) and "oom_kill 3" (/proc/vmstat,
// memory.events) both give that number as written (KiB for the former); -1 when there is none.
int64_t keyed_number(const std::string& text, const std::string& key);

// The whole file at `path` into `*text`; false (and `*text` untouched) when it cannot be opened.
bool read_text(const std::string& path, std::string* text);

// ---- a process's memory ---------------------------------------------------------------------------

// Resident and peak resident bytes of a process (/proc/PID/status VmRSS and VmHWM); -1 for a
// figure the kernel does not give (a process that is gone, a zombie, a system without /proc).
struct ProcessMemory {
  int64_t rss = -1;
  int64_t peak = -1;
};
ProcessMemory process_memory(pid_t pid);

// This process's resident bytes now (VmRSS); 0 where the kernel gives none.
int64_t process_rss_bytes();
// This process's RSS high-water mark in bytes (VmHWM) since it started or since the last
// reset_peak_rss(); 0 where the kernel gives none.
int64_t peak_rss_bytes();
// Brings the kernel's high-water mark of this process down to its current RSS (writes "5" to
// /proc/self/clear_refs), so that peak_rss_bytes() then gives the peak of a phase alone. The mark
// it clears is kept for lifetime_peak_rss_bytes(). Returns false where the kernel refuses (no
// /proc, a kernel without it): the mark then stays the process's peak so far.
bool reset_peak_rss();
// This process's peak RSS over its whole life, resets included: the most of getrusage's
// ru_maxrss, VmHWM now and every mark reset_peak_rss() cleared; 0 where none is known.
int64_t lifetime_peak_rss_bytes();
// The bytes glibc's heap has handed out and not had back (mallinfo2: uordblks + hblkhd, summed
// over every arena); 0 without glibc 2.33 or later.
int64_t heap_in_use_bytes();

// ---- the machine ------------------------------------------------------------------------------------

// The machine's memory (/proc/meminfo MemTotal and MemAvailable) in bytes; -1 for what it lacks.
struct HostMemory {
  int64_t total = -1;
  int64_t available = -1;
};
HostMemory host_memory();

// The bytes an unprivileged user may still write to the file system holding `path` (statvfs:
// f_bavail * f_frsize), or holding its nearest existing parent when `path` does not exist yet
// ("" is the working directory); -1 when no parent can be stat'ed.
int64_t free_disk_bytes(const std::string& path);

}  // namespace fsdp::sysinfo
