// fsdp-run's job: spawning the ranks, and one poll() loop that forwards output, notices exits,
// signals and deadlines, and drives the shutdown. Single-threaded on purpose, so that fork() is
// safe and every state change happens in one place. The command line, the ranks' environment and
// the POSIX helpers live beside it (launcher_internal.h).
#include "launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "launcher_internal.h"

extern char** environ;

namespace fsdp {
namespace launch {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
// A rank that draws a progress bar with '\r' never ends its line; past this size the pending
// bytes are forwarded as a line of their own instead of growing without bound.
constexpr size_t kMaxPendingLine = 64 * 1024;
// Reads per stream per wake-up, so that one chatty rank cannot starve the others' pipes.
constexpr int kReadsPerWakeup = 4;
// After the final SIGKILL every process in the ranks' groups dies at once; only a process that
// left its group (setsid) can still hold a pipe open, and it is not waited for longer than this.
constexpr std::chrono::milliseconds kDrainAfterKill(1000);
// poll() never sleeps longer than this, so deadlines are re-checked even if a wake-up were lost.
constexpr std::chrono::milliseconds kMaxPollWait(1000);
// How often each rank's resident memory is sampled (Note [A rank killed without a word]).
constexpr std::chrono::milliseconds kMemorySamplePeriod(250);

// ---- the job ---------------------------------------------------------------------------------

// Note [Zombie ranks pin their process group]: every rank leads its own process group (pgid ==
// pid), and the launcher signals the whole group with kill(-pgid) so that what the rank spawned
// goes down with it. A rank's exit is observed with waitid(WNOWAIT), which leaves it a zombie;
// it is reaped with waitpid only after its group got the final SIGKILL. While the zombie exists
// its pid cannot be reused, so kill(-pgid) can never reach an unrelated process group.
struct RankProcess {
  int rank = 0;
  pid_t pid = -1;       // also the process group id
  bool exited = false;  // observed with waitid(WNOWAIT), still a zombie
  bool reaped = false;
  int exit_code = 0;  // meaningful when term_signal == 0
  int term_signal = 0;

  bool failed() const { return exited && (term_signal != 0 || exit_code != 0); }
};

struct OutputStream {
  int fd = -1;  // read end of the rank's pipe; -1 once closed
  int rank = 0;
  int target_fd = STDOUT_FILENO;
  std::string pending;  // bytes after the last '\n' forwarded
};

enum class StopReason { kNone, kRankFailed, kTimeout, kSignal };

class LocalJob {
 public:
  LocalJob(const LaunchOptions& options, int master_port, int listen_fd, SignalPipe& signals)
      : options_(options), master_port_(master_port), listen_fd_(listen_fd), signals_(signals), buffer_(kReadChunk) {}

  // Exception safety: whatever was started is killed and reaped (a no-op after run()).
  ~LocalJob() {
    kill_and_reap_all();
    for (auto& stream : streams_) {
      if (stream.fd >= 0) ::close(stream.fd);
    }
    if (!plan_dir_.empty()) {
      for (const auto& rank : ranks_) ::unlink(plan_file(rank.rank).c_str());
      ::rmdir(plan_dir_.c_str());
    }
  }

  LocalJob(const LocalJob&) = delete;
  LocalJob& operator=(const LocalJob&) = delete;

  void spawn_all() {
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd < 0) throw std::runtime_error(errno_text("cannot open /dev/null"));
    try {
      set_fd_flag(null_fd, F_GETFD, F_SETFD, FD_CLOEXEC);
      if (const std::string threads = thread_default_note(options_.nproc_per_node); !threads.empty()) note(threads);
      oom_before_ = read_oom_counters();
      make_plan_dir();
      for (int rank = 0; rank < options_.nproc_per_node; ++rank) spawn_rank(rank, null_fd);
    } catch (...) {
      ::close(null_fd);
      throw;
    }
    ::close(null_fd);
  }

  int run() {
    const bool has_timeout = options_.timeout_s > 0;
    const Clock::time_point job_deadline = Clock::now() + to_duration(options_.timeout_s);
    std::vector<pollfd> fds;
    while (true) {
      sample_ranks();
      check_ranks();
      const Clock::time_point now = Clock::now();
      if (!shutting_down_ && has_timeout && now >= job_deadline) {
        stop_reason_ = StopReason::kTimeout;
        note("timed out after " + format_seconds(options_.timeout_s) + " s; stopping all ranks");
        begin_shutdown(SIGTERM);
      }
      // Every rank is gone; anything still in their groups is a leftover and gets the same
      // polite-then-forceful treatment (usually the groups are empty and this costs nothing).
      if (!shutting_down_ && all_exited()) begin_shutdown(SIGTERM);
      if (shutting_down_ && !killed_ && now >= kill_deadline_) kill_now();
      if (all_exited() && (all_streams_closed() || (killed_ && now >= drain_deadline_))) break;

      Clock::time_point wake = now + kMaxPollWait;
      if (!shutting_down_ && has_timeout) wake = std::min(wake, job_deadline);
      if (shutting_down_ && !killed_) wake = std::min(wake, kill_deadline_);
      if (killed_) wake = std::min(wake, drain_deadline_);
      if (!all_exited()) wake = std::min(wake, next_sample_);
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(wake - now).count();

      fds.clear();
      fds.push_back({signals_.read_fd(), POLLIN, 0});
      for (const auto& stream : streams_) fds.push_back({stream.fd, POLLIN, 0});  // -1: skipped
      if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait, 0))) < 0) {
        if (errno == EINTR) continue;
        throw std::runtime_error(errno_text("poll"));
      }
      if (fds[0].revents != 0) {
        for (int sig : signals_.take()) {
          if (sig != SIGCHLD) on_signal(sig);
        }
      }
      for (size_t i = 0; i < streams_.size(); ++i) {
        if (fds[i + 1].revents != 0) pump(streams_[i]);
      }
    }
    kill_and_reap_all();
    for (auto& stream : streams_) close_stream(stream);
    return report();
  }

 private:
  void spawn_rank(int rank, int null_fd) {
    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
    open_output_pipes(out_pipe, err_pipe);
    // Owned by streams_ from here on, so the destructor closes them if anything below throws.
    streams_.push_back({out_pipe[0], rank, STDOUT_FILENO, {}});
    streams_.push_back({err_pipe[0], rank, STDERR_FILENO, {}});

    // Everything the child needs is built before fork, so that the child only makes syscalls.
    std::vector<std::string> env = rank_environment(options_, rank, master_port_, listen_fd_, plan_file(rank));
    std::vector<char*> envp;
    for (auto& entry : env) envp.push_back(&entry[0]);
    envp.push_back(nullptr);
    std::vector<std::string> command = options_.command;
    std::vector<char*> argv;
    for (auto& arg : command) argv.push_back(&arg[0]);
    argv.push_back(nullptr);

    sigset_t saved_mask;
    ::sigprocmask(SIG_BLOCK, &signals_.blocked_during_fork(), &saved_mask);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Rank 0 inherits the master socket (Note [The master port is held, not picked]).
      if (rank == 0 && listen_fd_ >= 0) ::fcntl(listen_fd_, F_SETFD, 0);
      exec_rank(argv.data(), envp.data(), null_fd, out_pipe[1], err_pipe[1], saved_mask);
    }
    const int fork_errno = errno;
    ::sigprocmask(SIG_SETMASK, &saved_mask, nullptr);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    if (pid < 0) {
      errno = fork_errno;
      throw std::runtime_error(errno_text("cannot fork rank " + std::to_string(rank)));
    }
    // Also set here, so the group exists before the launcher could signal it, whichever of
    // parent and child runs first. EACCES (child already exec'd) means the child did it.
    ::setpgid(pid, pid);
    RankProcess process;
    process.rank = rank;
    process.pid = pid;
    ranks_.push_back(process);
    memory_.emplace_back();
  }

  // A private folder for the ranks' plans; without one (no writable TMPDIR) the ranks get none.
  void make_plan_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdp-run-XXXXXX";
    if (::mkdtemp(&path[0]) != nullptr) plan_dir_ = path;
  }

  std::string plan_file(int rank) const {
    return plan_dir_.empty() ? "" : plan_dir_ + "/rank" + std::to_string(rank) + ".plan";
  }

  void sample_ranks() {
    const Clock::time_point now = Clock::now();
    if (now < next_sample_) return;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (!ranks_[i].exited) sample_memory(ranks_[i].pid, &memory_[i]);
    }
    next_sample_ = now + kMemorySamplePeriod;
  }

  // Note [A rank killed without a word]
  void explain_if_killed_from_outside(const RankProcess& rank) {
    if (rank.term_signal != SIGKILL || killed_) return;
    KillReport report;
    report.rank = rank.rank;
    report.pid = rank.pid;
    report.died = Clock::now();
    report.memory = memory_[static_cast<size_t>(rank.rank)];
    for (const auto& m : memory_) report.all_ranks_rss += std::max<int64_t>(m.rss, 0);
    report.before = oom_before_;
    report.plan_file = plan_file(rank.rank);
    for (const std::string& line : explain_external_kill(report)) note(line);
  }

  // A rank's stdout and stderr pipes, read ends non-blocking. On failure none of them stays open.
  static void open_output_pipes(int out_pipe[2], int err_pipe[2]) {
    try {
      make_pipe(out_pipe);
      make_pipe(err_pipe);
      set_fd_flag(out_pipe[0], F_GETFL, F_SETFL, O_NONBLOCK);
      set_fd_flag(err_pipe[0], F_GETFL, F_SETFL, O_NONBLOCK);
    } catch (...) {
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) {
        if (fd >= 0) ::close(fd);
      }
      throw;
    }
  }

  // The child, between fork and exec: only syscalls from here on. Never returns.
  [[noreturn]] void exec_rank(char** argv, char** envp, int null_fd, int out_fd, int err_fd,
                              const sigset_t& saved_mask) const {
    // See Note [Zombie ranks pin their process group] for why it leads its own group.
    ::setpgid(0, 0);
    signals_.restore_in_child();
    ::sigprocmask(SIG_SETMASK, &saved_mask, nullptr);
    // stdin is /dev/null: a rank in a background process group that read the terminal would
    // be stopped by SIGTTIN, and N ranks sharing one stdin is never what was meant.
    if (::dup2(null_fd, STDIN_FILENO) < 0 || ::dup2(out_fd, STDOUT_FILENO) < 0 || ::dup2(err_fd, STDERR_FILENO) < 0) {
      ::_exit(127);
    }
    environ = envp;
    ::execvp(argv[0], argv);
    char message[1024];
    const int length =
        std::snprintf(message, sizeof(message), "fsdp-run: cannot execute %s: %s\n", argv[0], std::strerror(errno));
    if (length > 0) {
      const ssize_t ignored = ::write(STDERR_FILENO, message, std::min<size_t>(length, sizeof(message) - 1));
      (void)ignored;
    }
    ::_exit(127);
  }

  // Looks for ranks that exited, without reaping them (Note [Zombie ranks pin their process
  // group]). The first rank to fail stops the job.
  void check_ranks() {
    for (auto& rank : ranks_) {
      if (rank.exited) continue;
      siginfo_t info;
      std::memset(&info, 0, sizeof(info));
      if (::waitid(P_PID, static_cast<id_t>(rank.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
        if (errno == EINTR) continue;  // looked at again on the next wake-up
        throw std::runtime_error(errno_text("waitid for rank " + std::to_string(rank.rank)));
      }
      if (info.si_pid == 0) continue;  // still running
      rank.exited = true;
      if (info.si_code == CLD_EXITED) {
        rank.exit_code = info.si_status;
      } else {
        rank.term_signal = info.si_status;
      }
      if (rank.failed() && stop_reason_ == StopReason::kNone) {
        stop_reason_ = StopReason::kRankFailed;
        failed_rank_ = rank.rank;
        note("rank " + std::to_string(rank.rank) + " failed (" + describe_exit(rank) + "); stopping all ranks");
        explain_if_killed_from_outside(rank);
        begin_shutdown(SIGTERM);
      }
    }
  }

  // SIGINT/SIGTERM are forwarded as they are, the way torchrun passes its death signal on, so a
  // rank sees the same KeyboardInterrupt it would see without a launcher. A second signal while
  // shutting down skips the rest of the grace period.
  void on_signal(int sig) {
    if (!shutting_down_) {
      stop_reason_ = StopReason::kSignal;
      received_signal_ = sig;
      note("received " + signal_name(sig) + "; forwarding it to all ranks");
      begin_shutdown(sig);
    } else if (!killed_) {
      note("received " + signal_name(sig) + " again; killing all ranks now");
      kill_now();
    }
  }

  // Idempotent: the first call decides the signal and starts the grace period.
  void begin_shutdown(int sig) {
    if (shutting_down_) return;
    shutting_down_ = true;
    kill_deadline_ = Clock::now() + to_duration(options_.grace_s);
    signal_all_groups(sig);
  }

  void kill_now() {
    signal_all_groups(SIGKILL);
    killed_ = true;
    drain_deadline_ = Clock::now() + kDrainAfterKill;
  }

  void signal_all_groups(int sig) {
    for (const auto& rank : ranks_) {
      if (rank.reaped) continue;
      ::kill(-rank.pid, sig);  // ESRCH: the group is already empty
      // A stopped process would only act on the signal once continued.
      if (sig != SIGKILL) ::kill(-rank.pid, SIGCONT);
    }
  }

  // SIGKILL for whatever is left in the groups, then reap every rank. Idempotent.
  void kill_and_reap_all() {
    signal_all_groups(SIGKILL);
    for (auto& rank : ranks_) {
      if (rank.reaped) continue;
      int status = 0;
      pid_t result;
      while ((result = ::waitpid(rank.pid, &status, 0)) < 0 && errno == EINTR) {
      }
      rank.reaped = true;
      if (result == rank.pid && !rank.exited) {
        rank.exited = true;
        if (WIFEXITED(status)) rank.exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) rank.term_signal = WTERMSIG(status);
      }
    }
  }

  void pump(OutputStream& stream) {
    for (int i = 0; i < kReadsPerWakeup && stream.fd >= 0; ++i) {
      const ssize_t n = ::read(stream.fd, buffer_.data(), buffer_.size());
      if (n > 0) {
        stream.pending.append(buffer_.data(), static_cast<size_t>(n));
        forward_lines(stream, false);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      } else {
        close_stream(stream);  // EOF, or a read error that will not go away
      }
    }
  }

  // Forwards every complete line with its rank prefix in one write, so lines from different
  // ranks never interleave mid-line. At EOF the unterminated tail is forwarded too.
  void forward_lines(OutputStream& stream, bool at_eof) {
    const std::string prefix = "[rank " + std::to_string(stream.rank) + "] ";
    std::string out;
    size_t begin = 0;
    for (size_t end; (end = stream.pending.find('\n', begin)) != std::string::npos; begin = end + 1) {
      out += prefix;
      out.append(stream.pending, begin, end - begin + 1);
    }
    stream.pending.erase(0, begin);
    if (!stream.pending.empty() && (at_eof || stream.pending.size() >= kMaxPendingLine)) {
      out += prefix + stream.pending + "\n";
      stream.pending.clear();
    }
    if (!out.empty()) write_all(stream.target_fd, out);
  }

  void close_stream(OutputStream& stream) {
    if (stream.fd < 0) return;
    // Whatever is still readable (an escaped process may hold the pipe open), then the tail.
    ssize_t n;
    while ((n = ::read(stream.fd, buffer_.data(), buffer_.size())) > 0) {
      stream.pending.append(buffer_.data(), static_cast<size_t>(n));
      forward_lines(stream, false);
    }
    forward_lines(stream, true);
    ::close(stream.fd);
    stream.fd = -1;
  }

  bool all_exited() const {
    return std::all_of(ranks_.begin(), ranks_.end(), [](const RankProcess& r) { return r.exited; });
  }

  bool all_streams_closed() const {
    return std::all_of(streams_.begin(), streams_.end(), [](const OutputStream& s) { return s.fd < 0; });
  }

  static std::string describe_exit(const RankProcess& rank) {
    if (rank.term_signal != 0) return "killed by signal " + signal_name(rank.term_signal);
    return "exit code " + std::to_string(rank.exit_code);
  }

  // Prints the outcome and maps it to the exit status documented in launcher.h.
  int report() const {
    switch (stop_reason_) {
      case StopReason::kNone: return 0;
      case StopReason::kRankFailed: {
        const RankProcess& rank = ranks_[static_cast<size_t>(failed_rank_)];
        note("rank " + std::to_string(rank.rank) + " failed first (" + describe_exit(rank) + ")");
        const bool pass_through =
            rank.term_signal == 0 && rank.exit_code >= 1 && rank.exit_code <= kMaxRankExitCodePassedThrough;
        return pass_through ? rank.exit_code : 1;
      }
      case StopReason::kTimeout:
        note("timed out after " + format_seconds(options_.timeout_s) + " s");
        return kExitTimeout;
      case StopReason::kSignal: note("stopped by " + signal_name(received_signal_)); return 128 + received_signal_;
    }
    return 1;
  }

  const LaunchOptions& options_;
  const int master_port_;
  const int listen_fd_;  // -1: the user chose the port
  SignalPipe& signals_;
  std::vector<RankProcess> ranks_;
  std::vector<RankMemory> memory_;  // one per rank, by rank
  Clock::time_point next_sample_{};
  OomCounters oom_before_;
  std::string plan_dir_;  // "" when none could be made
  std::vector<OutputStream> streams_;
  std::vector<char> buffer_;
  StopReason stop_reason_ = StopReason::kNone;
  int failed_rank_ = -1;
  int received_signal_ = 0;
  bool shutting_down_ = false;  // the polite signal went out; grace period running
  bool killed_ = false;         // SIGKILL went out; only draining output now
  Clock::time_point kill_deadline_{};
  Clock::time_point drain_deadline_{};
};

}  // namespace
}  // namespace launch

int run_launcher(const LaunchOptions& options) {
  launch::validate(options);
  launch::ensure_standard_fds_open();
  int master_port = options.master_port;
  int listen_fd = -1;
  if (master_port == 0) listen_fd = launch::open_master_socket(options.master_addr, &master_port);
  try {
    launch::SignalPipe signals;                                      // installed before any rank exists
    launch::LocalJob job(options, master_port, listen_fd, signals);  // destroyed (ranks reaped) before signals
    job.spawn_all();
    // Rank 0 holds its own copy now; the launcher's would keep the port open after rank 0 died.
    if (listen_fd >= 0) ::close(std::exchange(listen_fd, -1));
    return job.run();
  } catch (...) {
    if (listen_fd >= 0) ::close(listen_fd);
    throw;
  }
}

}  // namespace fsdp
