// Implementation of the two multi-rank test tiers. See ranks.h.
#include "support/ranks.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <stdexcept>
#include <utility>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

namespace fsdp::testing {
namespace {
using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

HeldPort::HeldPort(bool listening) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || (listening && ::listen(fd_, 1024) != 0) ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string message = std::string("cannot hold a port on 127.0.0.1: ") + std::strerror(errno);
    close();
    throw std::runtime_error(message);
  }
  port_ = ntohs(addr.sin_port);
}

HeldPort::~HeldPort() { close(); }

int HeldPort::release() { return std::exchange(fd_, -1); }

void HeldPort::close() {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
}

// The paths temp_path handed out (a fresh name under TMPDIR or /tmp), with the process that asked
// for each: removed (files and
// folders, whatever the test left there) when that process exits normally. A forked rank runs the
// same exit handler but removes only its own paths, never its parent's.
struct HandedOut {
  std::mutex mu;
  std::vector<std::pair<pid_t, std::string>> paths;
};
HandedOut& handed_out() {
  static auto* paths = new HandedOut();  // never destroyed: the exit handler runs after statics die
  return *paths;
}
// PATH itself, and its siblings named PATH-..., PATH.... or PATH_... (tests add a suffix: "-a.bin",
// ".json"); no other handed-out name has such a prefix, each ends in its own counter.
void remove_handed_out_path(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = path.substr(0, slash), name = path.substr(slash + 1);
  std::vector<std::string> doomed;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string entry = e->d_name;
      if (entry.compare(0, name.size(), name) != 0) continue;
      if (entry.size() == name.size() || std::strchr("-._", entry[name.size()]) != nullptr)
        doomed.push_back(dir + "/" + entry);
    }
    ::closedir(d);
  }
  // nftw, not std::filesystem::remove_all: the test binaries link LibTorch, whose copy of that
  // symbol is the one resolved, and it crashed at exit.
  for (const std::string& p : doomed)
    ::nftw(
        p.c_str(), [](const char* f, const struct stat*, int, struct FTW*) { return ::remove(f); }, 16,
        FTW_DEPTH | FTW_PHYS);
}

void remove_handed_out_paths() {
  HandedOut& h = handed_out();
  std::lock_guard<std::mutex> lock(h.mu);
  for (const auto& [pid, path] : h.paths) {
    if (pid == ::getpid()) remove_handed_out_path(path);
  }
}

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(remove_handed_out_paths); });
  // pid + counter alone repeats: pids wrap (pid_max is often 32768) over a full test run, and a
  // FileStore file left by a killed test would hand a later process with the same pid the old
  // ranks' Gloo addresses ("Connection closed by peer" while creating a group). The start time
  // of this process makes the name unique.
  static const auto started = std::chrono::steady_clock::now().time_since_epoch().count();
  const char* dir = std::getenv("TMPDIR");
  std::ostringstream p;
  p << (dir ? dir : "/tmp") << "/fsdp-test-" << stem << "-" << ::getpid() << "-" << started << "-" << counter++;
  HandedOut& h = handed_out();
  std::lock_guard<std::mutex> lock(h.mu);
  h.paths.emplace_back(::getpid(), p.str());
  return p.str();
}

void run_threads(int world, const std::function<void(const std::shared_ptr<Dist>&)>& fn,
                 std::chrono::milliseconds timeout) {
  const std::string path = temp_path("filestore");
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::string> errors;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, world);
        auto dist = Dist::from_store(store, r, world, InitOptions().timeout(timeout));
        fn(dist);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  ::unlink(path.c_str());
  for (const auto& e : errors) ADD_FAILURE() << e;
}

std::vector<RankResult> run_processes(int world, const std::function<void(int)>& body, const ProcessOptions& options) {
  if (const char* child = std::getenv("FSDP_TEST_CHILD"); child && *child) {
    const int rank = std::atoi(std::getenv("RANK"));
    int code = 0;
    try {
      body(rank);
      if (::testing::Test::HasFailure()) code = 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d threw: %s\n", rank, e.what());
      code = 3;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(code);
  }

  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  // Rank 0 hosts the store on this socket; it is never closed between choosing the port and using
  // it (see HeldPort).
  HeldPort master;
  const int port = master.port();
  std::vector<pid_t> pids(world);
  std::vector<std::string> logs(world);
  std::vector<RankResult> results(world);
  const auto t0 = Clock::now();
  for (int r = 0; r < world; ++r) {
    logs[r] = temp_path("rank" + std::to_string(r) + ".log");
    results[r].rank = r;
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      const int fd = ::open(logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
      ::setenv("FSDP_TEST_CHILD", "1", 1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (r == 0) {
        ::setenv("FSDP_MASTER_LISTEN_FD", std::to_string(master.fd()).c_str(), 1);
      } else {
        ::unsetenv("FSDP_MASTER_LISTEN_FD");
        ::close(master.fd());
      }
      for (const auto& [k, v] : options.extra_env) ::setenv(k.c_str(), v.c_str(), 1);
      char exe[] = "/proc/self/exe";
      char* argv[] = {exe, const_cast<char*>(filter.c_str()), nullptr};
      ::execv("/proc/self/exe", argv);
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    pids[r] = pid;
  }
  // Only rank 0 holds the socket now: the store goes when rank 0 goes, as in a real job.
  master.close();
  int alive = world;
  std::vector<bool> done(world, false);
  const auto deadline = t0 + options.timeout;
  while (alive > 0) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got == pids[r]) {
        done[r] = true;
        --alive;
        results[r].seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        if (WIFEXITED(status)) results[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) results[r].term_signal = WTERMSIG(status);
      }
    }
    if (alive == 0) break;
    bool only_hangers = true;
    for (int r = 0; r < world; ++r) {
      const bool hanger = std::find(options.may_hang.begin(), options.may_hang.end(), r) != options.may_hang.end();
      if (!done[r] && !hanger) only_hangers = false;
    }
    if (only_hangers || Clock::now() >= deadline) {
      for (int r = 0; r < world; ++r) {
        if (done[r]) continue;
        ::kill(-pids[r], SIGKILL);
        ::kill(pids[r], SIGKILL);
        int status = 0;
        ::waitpid(pids[r], &status, 0);
        done[r] = true;
        results[r].killed_by_parent = true;
        results[r].term_signal = SIGKILL;
        results[r].seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int r = 0; r < world; ++r) {
    results[r].output = read_file(logs[r]);
    ::unlink(logs[r].c_str());
  }
  return results;
}

std::string describe(const std::vector<RankResult>& results) {
  std::ostringstream s;
  for (const auto& r : results) {
    s << "---- rank " << r.rank << ": exit " << r.exit_code << " signal " << r.term_signal
      << (r.killed_by_parent ? " (killed by the harness at the timeout)" : "") << " after " << r.seconds << " s\n"
      << r.output << "\n";
  }
  return s.str();
}

void expect_all_ok(const std::vector<RankResult>& results) {
  bool ok = true;
  for (const auto& r : results) ok = ok && r.ok();
  EXPECT_TRUE(ok) << describe(results);
}

}  // namespace fsdp::testing
