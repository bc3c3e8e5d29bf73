// fsdp-run's private parts, shared by its files:
//   launch_options.cpp  the command line: parsing, validation, --help text;
//   launch_env.cpp      what a rank starts with: the torchrun environment, the master port;
//   launch_memory.cpp   the ranks' memory, and why a rank died of a SIGKILL it was not sent;
//   launch_posix.cpp    small POSIX helpers and the signal self-pipe;
//   launcher.cpp        the job: spawning the ranks and supervising them in one poll() loop.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "launcher.h"

namespace fsdp {
namespace launch {

using Clock = std::chrono::steady_clock;

constexpr const char* kSynopsis =
    "fsdp-run --nproc-per-node N [--master-addr A] [--master-port P] [--timeout-s T] "
    "[--grace-s G] -- CMD [ARGS...]";

// ---- launch_options.cpp

// Throws std::invalid_argument when `options` cannot describe a job (see LaunchOptions).
void validate(const LaunchOptions& options);

// ---- launch_env.cpp

constexpr const char* kListenFdVariable = "FSDP_MASTER_LISTEN_FD";
constexpr int kListenBacklog = 1024;

// The environment of rank `rank`: the launcher's own, with torchrun's variables set for the job
// and OMP_NUM_THREADS unless set (Note [Threads per rank]); rank 0 also gets FSDP_MASTER_LISTEN_FD
// when `listen_fd` >= 0.
// `plan_file`, when not empty, goes to the rank as FSDP_RUN_PLAN_FILE.
std::vector<std::string> rank_environment(const LaunchOptions& options, int rank, int master_port, int listen_fd,
                                          const std::string& plan_file = "");

// Intra-op threads each rank gets unless OMP_NUM_THREADS is set: the cores this process may run on
// divided among the ranks, at least 1 (Note [Threads per rank]); and the line that says so ("" when
// the user set OMP_NUM_THREADS).
int threads_per_rank(int nproc_per_node);
std::string thread_default_note(int nproc_per_node);

// A close-on-exec TCP socket bound to a port the kernel chooses and listening; the port goes to
// *port. See Note [The master port is held, not picked].
int open_master_socket(const std::string& master_addr, int* port);

// ---- launch_memory.cpp (Note [A rank killed without a word])

// The variable naming the file a rank may write its plan to, one line (fsdp-train does).
constexpr const char* kPlanFileVariable = "FSDP_RUN_PLAN_FILE";

// A rank's resident memory as /proc/PID/status last showed it; -1 before the first sample.
struct RankMemory {
  int64_t rss = -1, peak = -1;
  Clock::time_point at{};
};
// Updates *memory from /proc/PID/status; leaves it as it was when the process is gone.
void sample_memory(pid_t pid, RankMemory* memory);

// The OOM killer's counters: the machine's (/proc/vmstat) and this process's memory cgroup's (the
// file named); -1 where there is none to read.
struct OomCounters {
  int64_t system = -1, cgroup = -1;
  std::string cgroup_file;
};
OomCounters read_oom_counters();

// The kernel log's record of PID killed by the OOM killer, "" when the log is unreadable or has none.
std::string kernel_log_oom_record(pid_t pid);

// What fsdp-run knows of a rank that died of a SIGKILL it did not send.
struct KillReport {
  int rank = 0;
  pid_t pid = -1;
  Clock::time_point died{};
  RankMemory memory;
  int64_t all_ranks_rss = 0;  // the ranks' last samples together
  OomCounters before;         // read when the job started
  std::string plan_file;      // "" when the rank had none
};
// The lines that say why the rank likely died, its memory, the machine's and its plan.
std::vector<std::string> explain_external_kill(const KillReport& report);

// ---- launch_posix.cpp

std::string errno_text(const std::string& what);
std::string signal_name(int sig);
std::string format_seconds(double seconds);
Clock::duration to_duration(double seconds);

// Writes everything, retrying on EINTR and waiting out EAGAIN. Returns false if the reader is gone.
bool write_all(int fd, const std::string& data);
// "fsdp-run: <message>" on stderr.
void note(const std::string& message);
void set_fd_flag(int fd, int get_cmd, int set_cmd, int flag);
// A pipe whose ends are both close-on-exec.
void make_pipe(int fds[2]);
// Parks /dev/null on a closed fd 0, 1 or 2.
void ensure_standard_fds_open();

// Owns the self-pipe (Note [Self-pipe]) and the launcher's signal dispositions for the duration of
// a job; restores the previous dispositions when destroyed. One at a time.
class SignalPipe {
 public:
  SignalPipe();
  ~SignalPipe();

  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return fds_[0]; }

  // The signals received since the last call, in order, SIGCHLD included.
  std::vector<int> take();

  // Blocked around fork() so that no handler runs in the child between fork and exec, where it
  // would write into the launcher's self-pipe and fake a signal to the launcher.
  const sigset_t& blocked_during_fork() const { return blocked_during_fork_; }

  // In the child, before exec: give back the dispositions the launcher itself was started with
  // (an ignored SIGPIPE or handled SIGINT must not leak into the ranks).
  void restore_in_child() const;

 private:
  static constexpr int kCount = 4;
  static constexpr int kSignals[kCount] = {SIGINT, SIGTERM, SIGCHLD, SIGPIPE};
  int fds_[2] = {-1, -1};
  struct sigaction saved_[kCount] {};
  sigset_t blocked_during_fork_;
};

}  // namespace launch
}  // namespace fsdp
