// What a rank starts with: the environment torchrun gives its workers, and the master port.
#include <arpa/inet.h>
#include <sched.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <utility>

#include "launcher_internal.h"

extern char** environ;

namespace fsdp {
namespace launch {
namespace {

constexpr const char* kRunId = "fsdp-run";

}  // namespace

// Note [Threads per rank]
// Ranks on one machine share its cores, and LibTorch's intra-op pool takes one thread per core by
// default, so P ranks would run P threads per core and spend their time preempting each other (2
// ranks on 2 cores: the example's 30 steps took 5-12 s against 0.4-0.8 s). torchrun sets
// OMP_NUM_THREADS=1 for each of several workers; fsdp-run gives each rank its share of the cores it
// may run on, cores / ranks (at least 1), as OMP_NUM_THREADS, which LibTorch's pool reads when it
// starts. A value the user set (in the launcher's environment) is left as it is.
int threads_per_rank(int nproc_per_node) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  return std::max(1, cores / std::max(1, nproc_per_node));
}

std::string thread_default_note(int nproc_per_node) {
  const char* set = std::getenv("OMP_NUM_THREADS");
  if (set != nullptr && *set != '\0') return "";
  const int threads = threads_per_rank(nproc_per_node);
  return "OMP_NUM_THREADS=" + std::to_string(threads) + " for each of " + std::to_string(nproc_per_node) +
         " rank(s) (the cores this launcher may use, divided among its ranks); set OMP_NUM_THREADS to choose";
}

std::vector<std::string> rank_environment(const LaunchOptions& options, int rank, int master_port, int listen_fd,
                                          const std::string& plan_file) {
  const std::string world = std::to_string(options.nproc_per_node);
  std::vector<std::pair<std::string, std::string>> overrides = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"WORLD_SIZE", world},
      {"LOCAL_WORLD_SIZE", world},
      {"GROUP_RANK", "0"},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", world},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"TORCHELASTIC_RUN_ID", kRunId},
  };
  if (rank == 0 && listen_fd >= 0) overrides.push_back({kListenFdVariable, std::to_string(listen_fd)});
  if (!plan_file.empty()) overrides.push_back({kPlanFileVariable, plan_file});
  const char* threads = std::getenv("OMP_NUM_THREADS");
  if (threads == nullptr || *threads == '\0') {
    overrides.push_back({"OMP_NUM_THREADS", std::to_string(threads_per_rank(options.nproc_per_node))});
  }
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const std::string key = text.substr(0, text.find('='));
    const bool overridden =
        std::any_of(overrides.begin(), overrides.end(), [&](const auto& kv) { return kv.first == key; });
    // The launcher's own socket (if it runs under another fsdp-run) is not the job's.
    if (!overridden && key != kListenFdVariable) env.push_back(text);
  }
  for (const auto& kv : overrides) env.push_back(kv.first + "=" + kv.second);
  return env;
}

// Note [The master port is held, not picked]: binding port 0, closing the socket and handing the
// number on leaves a window in which another process (another job's rank, an ephemeral port of a
// connect()) can take the port, and rank 0 then fails to host the store. The launcher instead
// keeps the socket bound and listening, hands it to rank 0 (FSDP_MASTER_LISTEN_FD; fsdp's
// init_process_group hosts the store on it) and closes its own copy once the ranks are started.
// Ranks that connect before rank 0 runs wait in the socket's backlog.
int open_master_socket(const std::string& master_addr, int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(errno_text("cannot create a socket for the master port"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  const bool loopback = master_addr == "localhost" || master_addr.rfind("127.", 0) == 0;
  addr.sin_addr.s_addr = htonl(loopback ? INADDR_LOOPBACK : INADDR_ANY);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, kListenBacklog) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    const std::string message = errno_text("cannot open a master port");
    ::close(fd);
    throw std::runtime_error(message + " (pass --master-port)");
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

}  // namespace launch
}  // namespace fsdp
