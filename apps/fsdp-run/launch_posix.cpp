// fsdp-run's POSIX helpers and its signal handling (the self-pipe).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "launcher_internal.h"

namespace fsdp {
namespace launch {

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
  if (flags < 0 || ::fcntl(fd, set_cmd, flags | flag) < 0) throw std::runtime_error(errno_text("fcntl"));
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
      throw std::runtime_error("cannot open /dev/null on closed standard descriptor " + std::to_string(fd));
    }
  }
}

// ---- signals ---------------------------------------------------------------------------------

namespace {

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

}  // namespace

// Owns the self-pipe and the launcher's signal dispositions for the duration of a job; restores
// the previous dispositions when destroyed. One at a time (see the global above).
SignalPipe::SignalPipe() {
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

SignalPipe::~SignalPipe() {
  for (int i = 0; i < kCount; ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
  g_signal_pipe_write = -1;
  ::close(fds_[0]);
  ::close(fds_[1]);
}

std::vector<int> SignalPipe::take() {
  std::vector<int> signals;
  unsigned char bytes[64];
  ssize_t n;
  while ((n = ::read(fds_[0], bytes, sizeof(bytes))) > 0 || (n < 0 && errno == EINTR)) {
    for (ssize_t i = 0; i < n; ++i) signals.push_back(bytes[i]);
  }
  return signals;
}

void SignalPipe::restore_in_child() const {
  for (int i = 0; i < kCount; ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
}

}  // namespace launch
}  // namespace fsdp
