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

std::vector<std::string> rank_environment(const LaunchOptions& options, int rank, int master_port) {
  const std::string world = std::to_string(options.nproc_per_node);
  const std::vector<std::pair<std::string, std::string>> overrides = {
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
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const std::string key = text.substr(0, text.find('='));
    const bool overridden =
        std::any_of(overrides.begin(), overrides.end(), [&](const auto& kv) { return kv.first == key; });
    if (!overridden) env.push_back(text);
  }
  for (const auto& kv : overrides) env.push_back(kv.first + "=" + kv.second);
  return env;
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

}  // namespace launch
}  // namespace fsdp
