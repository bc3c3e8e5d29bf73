// What fsdp-run knows of its ranks' memory, and why a rank died of a SIGKILL it did not send.
//
// Note [A rank killed without a word]: a rank that outgrows the machine's memory (or its memory
// cgroup's limit) is killed by the kernel's out-of-memory killer with SIGKILL: it prints nothing,
// and all the launcher sees is the signal. So the launcher samples each rank's resident memory as
// it runs (/proc/PID/status: VmRSS, and VmHWM, the peak), reads the OOM killer's counters at the
// start (/proc/vmstat's oom_kill for the machine, the memory cgroup's own counter: memory.events
// on cgroup v2, memory.oom_control on v1), and when a rank dies of a SIGKILL the launcher did not
// send it says which of these it has: a counter that rose means the OOM killer killed during the
// run (and the kernel log's line naming the rank's pid, when the log is readable, says whom);
// counters that did not move mean something else sent the signal; no counter to read leaves the
// OOM killer the likely cause. With that it prints the rank's last sampled memory, all ranks'
// together, the machine's, and the plan the rank wrote to FSDP_RUN_PLAN_FILE (fsdp-train does).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <sstream>

#include "launcher_internal.h"
#include "sysinfo/sysinfo.h"

namespace fsdp {
namespace launch {
using sysinfo::keyed_number;
using sysinfo::read_text;

namespace {

// The file that counts OOM kills in this process's memory cgroup, "" when there is none to read.
std::string cgroup_oom_file() {
  std::string cgroups;
  if (!read_text("/proc/self/cgroup", &cgroups)) return "";
  std::istringstream in(cgroups);
  std::string line, v1, v2;
  while (std::getline(in, line)) {
    // "ID:CONTROLLERS:PATH"; v2's unified hierarchy is "0::PATH".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) v2 = path;
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');)
      if (name == "memory") v1 = path;
  }
  const std::vector<std::string> candidates = {"/sys/fs/cgroup" + v2 + "/memory.events",
                                               "/sys/fs/cgroup/unified" + v2 + "/memory.events",
                                               "/sys/fs/cgroup/memory" + v1 + "/memory.oom_control"};
  for (size_t i = 0; i < candidates.size(); ++i) {
    if ((i < 2 && v2.empty()) || (i == 2 && v1.empty())) continue;
    std::string text;
    if (read_text(candidates[i], &text) && keyed_number(text, "oom_kill") >= 0) return candidates[i];
  }
  return "";
}

std::string mib(int64_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

// "fsdp-run's memory cgroup (DIR) is limited to N MiB" when the cgroup of `oom_file` has a limit;
// the OOM killer acts on it before the machine's memory runs out.
std::string cgroup_limit_line(const std::string& oom_file) {
  if (oom_file.empty()) return "";
  const std::string dir = oom_file.substr(0, oom_file.rfind('/'));
  const bool v1 = oom_file.find("oom_control") != std::string::npos;
  std::string limit;
  if (!read_text(dir + (v1 ? "/memory.limit_in_bytes" : "/memory.max"), &limit) || limit.empty() || limit[0] < '0' ||
      limit[0] > '9')
    return "";  // v2's "max": no limit
  const int64_t bytes = std::stoll(limit);
  return bytes < (int64_t{1} << 60) ? "fsdp-run's memory cgroup (" + dir + ") is limited to " + mib(bytes) : "";
}

}  // namespace

void sample_memory(pid_t pid, RankMemory* memory) {
  const sysinfo::ProcessMemory now = sysinfo::process_memory(pid);
  if (now.rss < 0) return;  // a zombie: its memory is already gone, the last sample stands
  memory->rss = now.rss;
  memory->peak = now.peak >= 0 ? now.peak : memory->peak;
  memory->at = Clock::now();
}

OomCounters read_oom_counters() {
  OomCounters counters;
  std::string text;
  if (read_text("/proc/vmstat", &text)) counters.system = keyed_number(text, "oom_kill");
  counters.cgroup_file = cgroup_oom_file();
  if (!counters.cgroup_file.empty() && read_text(counters.cgroup_file, &text))
    counters.cgroup = keyed_number(text, "oom_kill");
  return counters;
}

std::string kernel_log_oom_record(pid_t pid) {
  // /dev/kmsg gives one record per read, "PRIO,SEQ,USEC,FLAGS;MESSAGE"; EPIPE means records were
  // overwritten under the reader, which then goes on with the next one.
  const int fd = ::open("/dev/kmsg", O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  const std::string victim = "Killed process " + std::to_string(pid) + " ";
  std::string found;
  char record[8192];
  for (int i = 0; i < (1 << 20); ++i) {
    const ssize_t n = ::read(fd, record, sizeof record - 1);
    if (n < 0 && (errno == EPIPE || errno == EINTR)) continue;
    if (n <= 0) break;
    std::string text(record, static_cast<size_t>(n));
    if (text.find(victim) == std::string::npos) continue;
    const size_t body = text.find(';');
    text = body == std::string::npos ? text : text.substr(body + 1);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    found = text;  // the last one: a pid can be reused, the newest record is this rank's
  }
  ::close(fd);
  return found;
}

std::vector<std::string> explain_external_kill(const KillReport& r) {
  std::vector<std::string> lines;
  const std::string who = "rank " + std::to_string(r.rank);
  const OomCounters now = read_oom_counters();
  const bool system_rose = r.before.system >= 0 && now.system > r.before.system;
  const bool cgroup_rose =
      r.before.cgroup >= 0 && now.cgroup > r.before.cgroup && now.cgroup_file == r.before.cgroup_file;
  const bool readable = r.before.system >= 0 || r.before.cgroup >= 0;
  std::string counters;
  if (r.before.system >= 0)
    counters += "/proc/vmstat oom_kill " + std::to_string(r.before.system) + " -> " + std::to_string(now.system);
  if (r.before.cgroup >= 0)
    counters += (counters.empty() ? "" : ", ") + r.before.cgroup_file + " oom_kill " + std::to_string(r.before.cgroup) +
                " -> " + std::to_string(now.cgroup);
  // An old record of a reused pid must not speak for this run: the log is read only when a counter
  // rose or there is none to read.
  const std::string log = system_rose || cgroup_rose || !readable ? kernel_log_oom_record(r.pid) : "";
  if (!log.empty()) {
    lines.push_back(who + " was killed by the kernel's out-of-memory killer; the kernel log says: " + log);
  } else if (system_rose || cgroup_rose) {
    lines.push_back(who + " was killed by SIGKILL, which fsdp-run did not send; the kernel's out-of-memory killer " +
                    "killed during this run (" + counters + "), so it is the cause");
  } else if (readable) {
    lines.push_back(who + " was killed by SIGKILL, which fsdp-run did not send, and not by the kernel's " +
                    "out-of-memory killer (" + counters + "): another process or a person sent it");
  } else {
    lines.push_back(who + " was killed by SIGKILL, which fsdp-run did not send; the kernel's out-of-memory killer " +
                    "is the likely cause (this system shows no OOM counter to confirm it)");
  }
  if (r.memory.rss >= 0) {
    char ago[32];
    std::snprintf(ago, sizeof ago, "%.1f s", std::chrono::duration<double>(r.died - r.memory.at).count());
    lines.push_back(who + "'s resident memory at its last sample, " + ago + " before it died: " + mib(r.memory.rss) +
                    (r.memory.peak >= 0 ? " (peak " + mib(r.memory.peak) + ")" : "") + "; all ranks together " +
                    mib(r.all_ranks_rss));
  } else {
    lines.push_back(who + " died before its memory was sampled");
  }
  if (const sysinfo::HostMemory host = sysinfo::host_memory(); host.total >= 0 && host.available >= 0)
    lines.push_back("this machine: " + mib(host.total) + " of memory, " + mib(host.available) + " available now");
  if (const std::string limit = cgroup_limit_line(now.cgroup_file); !limit.empty()) lines.push_back(limit);
  std::string plan;
  if (!r.plan_file.empty() && read_text(r.plan_file, &plan) && !plan.empty()) {
    while (!plan.empty() && plan.back() == '\n') plan.pop_back();
    lines.push_back(who + "'s plan: " + plan);
  } else {
    lines.push_back(who + " wrote no plan (fsdp-train writes one to FSDP_RUN_PLAN_FILE before it loads the model)");
  }
  return lines;
}

}  // namespace launch
}  // namespace fsdp
