// What a rank starts with: the environment torchrun gives its workers, and the master port.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "launcher_internal.h"

extern char** environ;

namespace fsdp {
namespace launch {
namespace {

constexpr const char* kRunId = "fsdp-run";

}  // namespace

std::vector<std::string> rank_environment(const LaunchOptions& options, int rank, int master_port, int listen_fd) {
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
