// fsdp-run internals: argument parsing, spawning the ranks, and one poll() loop that forwards
// output, notices exits, signals and deadlines, and drives the shutdown. Single-threaded on
// purpose, so that fork() is safe and every state change happens in one place.
#include "launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kSynopsis =
    "fsdp-run --nproc-per-node N [--master-addr A] [--master-port P] [--timeout-s T] "
    "[--grace-s G] -- CMD [ARGS...]";
constexpr const char* kRunId = "fsdp-run";
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
constexpr double kMaxSeconds = 1e8;  // keeps the conversion to Clock::duration from overflowing

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    default: return "signal " + std::to_string(sig);
  }
}

std::string format_seconds(double seconds) {
  std::ostringstream out;
  out << seconds;  // 2 -> "2", 1.5 -> "1.5"
  return out.str();
}

Clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// ---- argument parsing ------------------------------------------------------------------------

long parse_integer(const std::string& flag, const std::string& text, long lo, long hi,
                   const char* expected) {
  const bool digits =
      !text.empty() && text.size() <= 9 &&
      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  const long value = digits ? std::strtol(text.c_str(), nullptr, 10) : 0;
  if (!digits || value < lo || value > hi) {
    throw std::invalid_argument(flag + " must be " + expected + ", got '" + text + "'");
  }
  return value;
}

double parse_seconds(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const double value = text.empty() ? -1 : std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || *end != '\0' || !std::isfinite(value) || value < 0 ||
      value > kMaxSeconds) {
    throw std::invalid_argument(flag + " must be a number of seconds in [0, " +
                                format_seconds(kMaxSeconds) + "], got '" + text + "'");
  }
  return value;
}

void validate(const LaunchOptions& options) {
  if (options.nproc_per_node < 1 || options.nproc_per_node > kMaxProcsPerNode) {
    throw std::invalid_argument("--nproc-per-node must be an integer in [1, " +
                                std::to_string(kMaxProcsPerNode) + "], got " +
                                std::to_string(options.nproc_per_node));
  }
  if (options.command.empty()) {
    throw std::invalid_argument(std::string("missing command after '--'; usage: ") + kSynopsis);
  }
  if (options.master_addr.empty()) throw std::invalid_argument("--master-addr must not be empty");
  if (options.master_port < 0 || options.master_port > 65535) {
    throw std::invalid_argument("--master-port must be in [1, 65535], got " +
                                std::to_string(options.master_port));
  }
  if (!(options.timeout_s >= 0 && options.timeout_s <= kMaxSeconds) ||
      !(options.grace_s >= 0 && options.grace_s <= kMaxSeconds)) {
    throw std::invalid_argument("--timeout-s and --grace-s must be in [0, " +
                                format_seconds(kMaxSeconds) + "] seconds");
  }
}

// ---- small POSIX helpers ---------------------------------------------------------------------

// Writes everything, retrying on EINTR and waiting out EAGAIN (our stdout may be a non-blocking
// fd we inherited). Returns false if the reader is gone: losing output must not stop the job.
bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd waiter{fd, POLLOUT, 0};
      ::poll(&waiter, 1, -1);
    } else {
      return false;
    }
  }
  return true;
}

void note(const std::string& message) { write_all(STDERR_FILENO, "fsdp-run: " + message + "\n"); }

void set_fd_flag(int fd, int get_cmd, int set_cmd, int flag) {
  const int flags = ::fcntl(fd, get_cmd);
  if (flags < 0 || ::fcntl(fd, set_cmd, flags | flag) < 0)
    throw std::runtime_error(errno_text("fcntl"));
}

// A pipe whose ends are both close-on-exec: otherwise every rank would inherit the other ranks'
// write ends, and no pipe would reach EOF before all ranks exit.
void make_pipe(int fds[2]) {
  if (::pipe(fds) != 0) throw std::runtime_error(errno_text("cannot create a pipe"));
  set_fd_flag(fds[0], F_GETFD, F_SETFD, FD_CLOEXEC);
  set_fd_flag(fds[1], F_GETFD, F_SETFD, FD_CLOEXEC);
}

// A launcher started with fd 0, 1 or 2 closed would get a pipe there, and the child's dup2 onto
// 0-2 would then clobber it. Parking /dev/null on the gaps keeps every pipe at 3 or above.
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF && ::open("/dev/null", O_RDWR) != fd) {
      throw std::runtime_error("cannot open /dev/null on closed standard descriptor " +
                               std::to_string(fd));
    }
  }
}

// Binds port 0 on loopback and returns the port the kernel chose. The port is free again once
// the socket closes, so another process could take it before rank 0 binds; torchrun accepts the
// same race.
int pick_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(errno_text("cannot create a socket to pick a master port"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    const std::string message = errno_text("cannot pick a free port on 127.0.0.1");
    ::close(fd);
    throw std::runtime_error(message + " (pass --master-port)");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// ---- signals ---------------------------------------------------------------------------------

// Note [Self-pipe]: a signal handler may only do async-signal-safe work, so it writes the signal
// number into a pipe that the poll() loop watches; SIGINT/SIGTERM are then handled like any other
// event, and SIGCHLD merely wakes the loop to look at the ranks. The write end is a global
// because a handler gets no user pointer.
int g_signal_pipe_write = -1;

void on_launcher_signal(int sig) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // A full pipe is already readable, so a dropped byte loses nothing but a duplicate.
  const ssize_t ignored = ::write(g_signal_pipe_write, &byte, 1);
  (void)ignored;
  errno = saved_errno;
}

// Owns the self-pipe and the launcher's signal dispositions for the duration of a job; restores
// the previous dispositions when destroyed. One at a time (see the global above).
class SignalPipe {
 public:
  SignalPipe() {
    make_pipe(fds_);
    set_fd_flag(fds_[0], F_GETFL, F_SETFL, O_NONBLOCK);
    set_fd_flag(fds_[1], F_GETFL, F_SETFL, O_NONBLOCK);
    g_signal_pipe_write = fds_[1];
    struct sigaction handler {};
    handler.sa_handler = on_launcher_signal;
    sigemptyset(&handler.sa_mask);
    handler.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (int i = 0; i < kCount; ++i) {
      ::sigaction(kSignals[i], nullptr, &saved_[i]);
      // An ignored SIGINT means we were started in the background or under nohup; keep
      // honouring that, as shells and Python do.
      if (kSignals[i] == SIGINT && saved_[i].sa_handler == SIG_IGN) continue;
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      // SIGPIPE is ignored so that a closed stdout turns into EPIPE (output dropped, job goes on)
      // instead of killing the launcher and orphaning the ranks.
      ::sigaction(kSignals[i], kSignals[i] == SIGPIPE ? &ignore : &handler, nullptr);
    }
    sigemptyset(&blocked_during_fork_);
    for (int sig : kSignals) sigaddset(&blocked_during_fork_, sig);
  }

  ~SignalPipe() {
    for (int i = 0; i < kCount; ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
    g_signal_pipe_write = -1;
    ::close(fds_[0]);
    ::close(fds_[1]);
  }

  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return fds_[0]; }

  // The signals received since the last call, in order, SIGCHLD included.
  std::vector<int> take() {
    std::vector<int> signals;
    unsigned char bytes[64];
    ssize_t n;
    while ((n = ::read(fds_[0], bytes, sizeof(bytes))) > 0 || (n < 0 && errno == EINTR)) {
      for (ssize_t i = 0; i < n; ++i) signals.push_back(bytes[i]);
    }
    return signals;
  }

  // Blocked around fork() so that no handler runs in the child between fork and exec, where it
  // would write into the launcher's self-pipe and fake a signal to the launcher.
  const sigset_t& blocked_during_fork() const { return blocked_during_fork_; }

  // In the child, before exec: give back the dispositions the launcher itself was started with
  // (an ignored SIGPIPE or handled SIGINT must not leak into the ranks).
  void restore_in_child() const {
    for (int i = 0; i < kCount; ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
  }

 private:
  static constexpr int kCount = 4;
  static constexpr int kSignals[kCount] = {SIGINT, SIGTERM, SIGCHLD, SIGPIPE};
  int fds_[2] = {-1, -1};
  struct sigaction saved_[kCount] {};
  sigset_t blocked_during_fork_;
};

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
  LocalJob(const LaunchOptions& options, int master_port, SignalPipe& signals)
      : options_(options), master_port_(master_port), signals_(signals), buffer_(kReadChunk) {}

  // Exception safety: whatever was started is killed and reaped (a no-op after run()).
  ~LocalJob() {
    kill_and_reap_all();
    for (auto& stream : streams_) {
      if (stream.fd >= 0) ::close(stream.fd);
    }
  }

  LocalJob(const LocalJob&) = delete;
  LocalJob& operator=(const LocalJob&) = delete;

  void spawn_all() {
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd < 0) throw std::runtime_error(errno_text("cannot open /dev/null"));
    try {
      set_fd_flag(null_fd, F_GETFD, F_SETFD, FD_CLOEXEC);
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
  std::vector<std::string> rank_environment(int rank) const {
    const std::string world = std::to_string(options_.nproc_per_node);
    const std::vector<std::pair<std::string, std::string>> overrides = {
        {"RANK", std::to_string(rank)},
        {"LOCAL_RANK", std::to_string(rank)},
        {"WORLD_SIZE", world},
        {"LOCAL_WORLD_SIZE", world},
        {"GROUP_RANK", "0"},
        {"ROLE_RANK", std::to_string(rank)},
        {"ROLE_WORLD_SIZE", world},
        {"MASTER_ADDR", options_.master_addr},
        {"MASTER_PORT", std::to_string(master_port_)},
        {"TORCHELASTIC_RUN_ID", kRunId},
    };
    std::vector<std::string> env;
    for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
      const std::string text(*entry);
      const std::string key = text.substr(0, text.find('='));
      const bool overridden = std::any_of(overrides.begin(), overrides.end(),
                                          [&](const auto& kv) { return kv.first == key; });
      if (!overridden) env.push_back(text);
    }
    for (const auto& kv : overrides) env.push_back(kv.first + "=" + kv.second);
    return env;
  }

  void spawn_rank(int rank, int null_fd) {
    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
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
    // Owned by streams_ from here on, so the destructor closes them if anything below throws.
    streams_.push_back({out_pipe[0], rank, STDOUT_FILENO, {}});
    streams_.push_back({err_pipe[0], rank, STDERR_FILENO, {}});

    // Everything the child needs is built before fork, so that the child only makes syscalls.
    std::vector<std::string> env = rank_environment(rank);
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
      // Child. See Note [Zombie ranks pin their process group] for why it leads its own group.
      ::setpgid(0, 0);
      signals_.restore_in_child();
      ::sigprocmask(SIG_SETMASK, &saved_mask, nullptr);
      // stdin is /dev/null: a rank in a background process group that read the terminal would
      // be stopped by SIGTTIN, and N ranks sharing one stdin is never what was meant.
      if (::dup2(null_fd, STDIN_FILENO) < 0 || ::dup2(out_pipe[1], STDOUT_FILENO) < 0 ||
          ::dup2(err_pipe[1], STDERR_FILENO) < 0) {
        ::_exit(127);
      }
      environ = envp.data();
      ::execvp(argv[0], argv.data());
      char message[1024];
      const int length =
          std::snprintf(message, sizeof(message), "fsdp-run: cannot execute %s: %s\n", argv[0],
                        std::strerror(errno));
      if (length > 0) {
        const ssize_t ignored =
            ::write(STDERR_FILENO, message, std::min<size_t>(length, sizeof(message) - 1));
        (void)ignored;
      }
      ::_exit(127);
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
        note("rank " + std::to_string(rank.rank) + " failed (" + describe_exit(rank) +
             "); stopping all ranks");
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
    for (size_t end; (end = stream.pending.find('\n', begin)) != std::string::npos;
         begin = end + 1) {
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
    return std::all_of(streams_.begin(), streams_.end(),
                       [](const OutputStream& s) { return s.fd < 0; });
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
        const bool pass_through = rank.term_signal == 0 && rank.exit_code >= 1 &&
                                  rank.exit_code <= kMaxRankExitCodePassedThrough;
        return pass_through ? rank.exit_code : 1;
      }
      case StopReason::kTimeout:
        note("timed out after " + format_seconds(options_.timeout_s) + " s");
        return kExitTimeout;
      case StopReason::kSignal:
        note("stopped by " + signal_name(received_signal_));
        return 128 + received_signal_;
    }
    return 1;
  }

  const LaunchOptions& options_;
  const int master_port_;
  SignalPipe& signals_;
  std::vector<RankProcess> ranks_;
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

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions options;
  bool saw_nproc = false;
  size_t i = 0;
  for (; i < args.size() && args[i] != "--"; ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      options.show_help = true;
      return options;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      throw std::invalid_argument("unexpected argument '" + arg +
                                  "': the command goes after '--'; usage: " + kSynopsis);
    }
    const size_t equals = arg.find('=');
    std::string flag = arg.substr(0, equals);
    std::replace(flag.begin(), flag.end(), '_', '-');  // torchrun accepts --nproc_per_node too
    static const char* const kFlags[] = {"--nproc-per-node", "--master-addr", "--master-port",
                                         "--timeout-s", "--grace-s"};
    if (std::none_of(std::begin(kFlags), std::end(kFlags),
                     [&](const char* f) { return flag == f; })) {
      throw std::invalid_argument("unknown option '" + arg.substr(0, equals) +
                                  "' (see fsdp-run --help)");
    }
    std::string value;
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (i + 1 < args.size() && args[i + 1] != "--") {
      value = args[++i];
    } else {
      throw std::invalid_argument("option " + flag + " needs a value");
    }
    if (flag == "--nproc-per-node") {
      options.nproc_per_node = static_cast<int>(parse_integer(
          flag, value, 1, kMaxProcsPerNode,
          ("a positive integer (at most " + std::to_string(kMaxProcsPerNode) + ")").c_str()));
      saw_nproc = true;
    } else if (flag == "--master-addr") {
      if (value.empty()) throw std::invalid_argument("--master-addr must not be empty");
      options.master_addr = value;
    } else if (flag == "--master-port") {
      options.master_port =
          static_cast<int>(parse_integer(flag, value, 1, 65535, "an integer in [1, 65535]"));
    } else if (flag == "--timeout-s") {
      options.timeout_s = parse_seconds(flag, value);
    } else {
      options.grace_s = parse_seconds(flag, value);
    }
  }
  if (i == args.size()) {
    throw std::invalid_argument(std::string("missing '--' before the command; usage: ") +
                                kSynopsis);
  }
  if (!saw_nproc)
    throw std::invalid_argument(std::string("--nproc-per-node is required; usage: ") + kSynopsis);
  options.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  validate(options);
  return options;
}

std::string launch_usage() {
  return std::string("usage: ") + kSynopsis + R"(

Runs CMD once per rank on this machine, with the environment torchrun gives its workers:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, ROLE_RANK, ROLE_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID=fsdp-run. Every line a rank prints is forwarded
with a "[rank K] " prefix (stdout to stdout, stderr to stderr). The first rank that fails stops
the job: the other ranks' process groups get SIGTERM, then SIGKILL after the grace period.

options:
  --nproc-per-node N   number of ranks to start, 1..1024 (required)
  --master-addr A      rendezvous address (default 127.0.0.1)
  --master-port P      rendezvous port (default: a free port on 127.0.0.1)
  --timeout-s T        stop the job after T seconds; 0 = no limit (default 0)
  --grace-s G          seconds between SIGTERM and SIGKILL (default 5)
  -h, --help           show this help
Flags may also be written --flag=value, and with '_' for '-'.

exit status:
  0      every rank exited 0
  C      the first failing rank's exit code, when it is 1..123
  1      the first failing rank exited with 124..255 or was killed by a signal
  2      bad usage, or the launcher could not start the job
  124    --timeout-s expired
  128+S  the launcher received signal S (130: SIGINT, 143: SIGTERM)
)";
}

int run_launcher(const LaunchOptions& options) {
  validate(options);
  ensure_standard_fds_open();
  const int master_port = options.master_port != 0 ? options.master_port : pick_free_port();
  SignalPipe signals;                           // installed before any rank exists
  LocalJob job(options, master_port, signals);  // destroyed (ranks reaped) before signals
  job.spawn_all();
  return job.run();
}

}  // namespace fsdp
