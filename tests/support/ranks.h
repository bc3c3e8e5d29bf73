// Multi-rank test harness, two tiers (docs/ARCHITECTURE.md, "Tests: tiers and what to run"):
//  - run_threads: ranks as threads of this process, a FileStore on a temp file, Gloo on 127.0.0.1.
//    Fast; for collectives and sharding logic.
//  - run_processes: the test binary re-executed once per rank (only the current test runs in each
//    child), torchrun-style variables, a timeout enforced by the parent, every rank's output kept,
//    stragglers killed. For autograd, global state and fault tests.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/dist.h"

namespace fsdp::testing {

using namespace std::chrono_literals;

// Runs fn(dist) on `world` threads, each with its own Dist, which the rank owns: it ends when fn
// returns (or throws), and fn passes it on wherever a std::shared_ptr<Dist> is taken (DeviceMesh).
// Exceptions from any rank become test failures naming the rank.
void run_threads(int world, const std::function<void(const std::shared_ptr<Dist>&)>& fn,
                 std::chrono::milliseconds timeout = 20s);

struct RankResult {
  int rank = -1;
  int exit_code = -1;   // when exited normally
  int term_signal = 0;  // when killed by a signal
  bool killed_by_parent = false;
  double seconds = 0;  // from spawn to exit
  std::string output;  // stdout and stderr
  bool ok() const { return term_signal == 0 && exit_code == 0; }
};

struct ProcessOptions {
  std::chrono::milliseconds timeout = 60s;  // the parent kills every rank after this
  std::vector<std::pair<std::string, std::string>> extra_env;
  // Ranks expected to hang (e.g. SIGSTOPped): once every other rank has exited they are killed.
  std::vector<int> may_hang;
};

// In the parent: spawns `world` children running this test and returns their results (the caller
// asserts on them). In a child (FSDP_TEST_CHILD set): runs body(rank) and exits: 0 when it returns
// without a test failure, 1 on a failure, 3 when it throws (the message goes to stderr).
std::vector<RankResult> run_processes(int world, const std::function<void(int rank)>& body,
                                      const ProcessOptions& options = {});

// Asserts every rank exited 0; on failure prints every rank's output.
void expect_all_ok(const std::vector<RankResult>& results);
std::string describe(const std::vector<RankResult>& results);

// A TCP socket on 127.0.0.1 bound to a port the kernel chose, held for the object's life so that no
// other process can take the port (binding port 0, closing and handing the number on is a race
// that failed tests running side by side). Listening, it is what rank 0 hosts the store on
// (DistEnv::master_listen_fd, FSDP_MASTER_LISTEN_FD); bound only, connecting to it is refused.
class HeldPort {
 public:
  explicit HeldPort(bool listening = true);
  ~HeldPort();
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }
  int fd() const { return fd_; }
  // Gives the socket away (to a store that closes it); the port stays taken by the new owner.
  int release();
  void close();

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::string temp_path(const std::string& stem);

}  // namespace fsdp::testing
