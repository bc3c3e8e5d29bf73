// Rendezvous: TCPStore on MASTER_ADDR:MASTER_PORT (rank 0 hosts it), a join check that names the
// ranks that never arrived, and the world communicator over Gloo.
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/host_malloc.h"
#include "base/strings.h"
#include "comm/communicator_impl.h"
#include "comm/first_use.h"
#include "comm/transport.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace {

using base::first_line;

// InitOptions::check_collectives, or FSDP_CHECK_COLLECTIVES=1 in the environment (a debug switch
// that needs no code change in the training program).
bool check_collectives(const InitOptions& options) {
  if (options.check_collectives()) return true;
  const char* v = std::getenv("FSDP_CHECK_COLLECTIVES");
  return v != nullptr && std::string(v) == "1";
}

double as_seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

std::string seconds_text(std::chrono::milliseconds ms) {
  std::ostringstream s;
  s << as_seconds(ms) << " s";
  return s.str();
}

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1"; }

// Every rank announces itself, then waits for all others; on timeout the error lists who is missing.
//
// Note [Every joined rank names the missing ones]
// All joined ranks time out at about the same moment, and rank 0's exit takes the store with it,
// so a rank a little behind would only see "connection closed". The first rank to time out posts
// its message under fsdp/join_failed; every rank polls that key and fails with the same message;
// the store host (rank 0) waits up to a second for the others to read it before it goes.
void join_check(c10d::Store& store, int rank, int world_size, std::chrono::milliseconds timeout) {
  const std::string failed_key = "fsdp/join_failed";
  store.set("fsdp/joined/" + std::to_string(rank), std::vector<uint8_t>{1});
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int r = 0; r < world_size; ++r) {
      if (!store.check({"fsdp/joined/" + std::to_string(r)})) missing.push_back(r);
    }
    if (missing.empty()) return;
    if (store.check({failed_key})) {
      const auto v = store.get(failed_key);
      store.set("fsdp/join_failed_seen/" + std::to_string(rank), std::vector<uint8_t>{1});
      throw TimeoutError(std::string(v.begin(), v.end()) + " (reported to rank " + std::to_string(rank) + ")");
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ostringstream msg;
  msg << "fsdp: rendezvous timed out after " << seconds_text(timeout) << " on rank " << rank << ": rank"
      << (missing.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < missing.size() && i < 16; ++i) msg << (i ? ", " : "") << missing[i];
  if (missing.size() > 16) msg << ", ...";
  msg << " of " << world_size << " never joined (check that every rank was started with the same "
      << "MASTER_ADDR/MASTER_PORT and WORLD_SIZE)";
  const std::string text = msg.str();
  if (!store.check({failed_key})) store.set(failed_key, std::vector<uint8_t>(text.begin(), text.end()));
  if (rank == 0) {
    // See Note [Every joined rank names the missing ones].
    const auto linger = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (;;) {
      bool all_seen = true;
      for (int r = 1; r < world_size && all_seen; ++r) {
        const std::string id = std::to_string(r);
        all_seen = !store.check({"fsdp/joined/" + id}) || store.check({"fsdp/join_failed_seen/" + id});
      }
      if (all_seen || std::chrono::steady_clock::now() >= linger) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  throw TimeoutError(text);
}

// The options of a group of more than one rank: the order check's board is the rendezvous store.
CommunicatorOptions group_options(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& global_ranks,
                                  const std::string& name, const InitOptions& options) {
  CommunicatorOptions copts;
  copts.name = name;
  copts.timeout = options.timeout();
  copts.global_ranks = global_ranks;
  copts.check_order = check_collectives(options);
  if (copts.check_order) {
    copts.order_post = [store](const std::string& key, const std::string& value) {
      store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    };
    copts.order_lookup = [store](const std::string& key) -> std::optional<std::string> {
      if (!store->check({key})) return std::nullopt;
      const auto raw = store->get(key);
      return std::string(raw.begin(), raw.end());
    };
  }
  return copts;
}

std::shared_ptr<Communicator> make_group(const c10::intrusive_ptr<c10d::Store>& store, int group_rank, int group_size,
                                         const std::vector<int>& global_ranks, const std::string& name,
                                         const InitOptions& options, const std::string& hostname) {
  // One rank: local copies, no order check (a one-rank group runs each collective at once).
  if (group_size == 1) return make_local_group(name, global_ranks.at(0), options.timeout());
  CpuTransportOptions gopts;
  gopts.timeout = options.timeout();
  gopts.threads = options.gloo_threads();
  gopts.hostname = hostname;
  gopts.mode = options.cpu_transport();
  gopts.host_id = options.host_id();
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp/group/" + name, store);
  if (options.device() != "cpu" && options.device() != "cuda") {
    throw ConfigError("fsdp: InitOptions::device must be \"cpu\" or \"cuda\", got \"" + options.device() + "\"");
  }
  std::unique_ptr<Transport> transport;
  try {
    transport = options.device() == "cuda" ? make_nccl_transport(prefixed, group_rank, group_size, options.timeout())
                                           : make_cpu_transport(prefixed, group_rank, group_size, gopts);
    // Note [A group is ready when every member is]: Gloo's full mesh returns on a rank once its
    // own side of every connection is up, not the peer's. A rank that then used the group for
    // nothing and destroyed it (a load that needs no collective, a job that fails its next
    // check) closed connections a slower peer was still finishing: "connectFullMesh failed ...
    // Connection closed by peer" on that peer. The barrier returns on no member before every
    // member's connections are up. Not counted in the communicator's stats.
    TransferCount uncounted;
    transport->barrier(uncounted);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& e) {
    throw DistError("fsdp: creating process group '" + name + "' failed on group rank " + std::to_string(group_rank) +
                    " of " + std::to_string(group_size) + " within " + seconds_text(options.timeout()) + ": " +
                    first_line(e));
  }
  return make_communicator(std::move(transport), group_options(store, global_ranks, name, options));
}

// FSDP_MASTER_LISTEN_FD must name a socket bound to MASTER_PORT: anything else (a closed fd, a
// file, another port) would host the store where the other ranks do not look.
void check_listen_fd(const DistEnv& env) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int port = -1;
  if (::getsockname(env.master_listen_fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    if (addr.ss_family == AF_INET) port = ntohs(reinterpret_cast<const sockaddr_in&>(addr).sin_port);
    if (addr.ss_family == AF_INET6) port = ntohs(reinterpret_cast<const sockaddr_in6&>(addr).sin6_port);
  }
  if (port != env.master_port) {
    throw EnvError("fsdp: FSDP_MASTER_LISTEN_FD=" + std::to_string(env.master_listen_fd) +
                   " is not a TCP socket bound to MASTER_PORT=" + std::to_string(env.master_port) +
                   (port > 0 ? " (it is bound to port " + std::to_string(port) + ")" : "") +
                   " (the launcher passes it to rank 0; unset it when starting rank 0 by hand)");
  }
}

// The rendezvous store: rank 0 hosts it on MASTER_PORT (or on the socket the launcher handed
// down) and the others connect, or, under torchrun's agent store, every rank connects to the
// agent's, whose keys of earlier restarts are kept apart by a prefix.
c10::intrusive_ptr<c10d::Store> open_store(const DistEnv& env, const InitOptions& options) {
  c10d::TCPStoreOptions sopts;
  sopts.port = static_cast<uint16_t>(env.master_port);
  sopts.isServer = env.rank == 0 && !env.agent_store;
  sopts.numWorkers = env.world_size;
  sopts.waitWorkers = false;  // join_check names the missing ranks instead
  sopts.timeout = options.timeout();
  if (sopts.isServer && env.master_listen_fd >= 0) {
    check_listen_fd(env);
    sopts.masterListenFd = env.master_listen_fd;
  }
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, sopts);
  } catch (const std::exception& e) {
    if (sopts.isServer) {
      throw DistError("fsdp: rank 0 could not host the rendezvous store on " + where +
                      " (MASTER_ADDR/MASTER_PORT; is the port already in use?): " + first_line(e));
    }
    const std::string host = env.agent_store ? "torchrun's agent" : "rank 0";
    throw DistError("fsdp: rank " + std::to_string(env.rank) + " could not reach the rendezvous store on " + where +
                    " within " + seconds_text(options.timeout()) + " (MASTER_ADDR/MASTER_PORT; is " + host +
                    " running?): " + first_line(e));
  }
  if (!env.agent_store) return store;
  return c10::make_intrusive<c10d::PrefixStore>("fsdp/attempt/" + std::to_string(env.restart_count), store);
}

}  // namespace

namespace {

// InitOptions::device resolved to a device, once per Dist (see Dist::compute_device).
c10::Device resolve_device(const InitOptions& options) {
  if (options.device() != "cuda") return c10::Device(c10::kCPU);
  if (!at::detail::getCUDAHooks().hasCUDA()) {
    throw ConfigError(
        "fsdp: InitOptions::device is \"cuda\" but no CUDA device is usable in this process "
        "(no GPU, CUDA_VISIBLE_DEVICES hides them, or LibTorch was built without CUDA)");
  }
  try {
    return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice();
  } catch (const std::exception& e) {
    throw ConfigError("fsdp: InitOptions::device is \"cuda\" but the current CUDA device could not be read: " +
                      first_line(e));
  }
}

}  // namespace

// Note [The math library's first call]
// MKL's vector math, which ATen calls for tanh and other elementwise functions of float CPU tensors,
// detects the CPU on its first call and publishes the answer in two unguarded writes: the raw
// detection, then the code path it maps to. A thread whose first call lands between the two uses
// the raw value as its path, and another path is another kernel (tanh on path 5 and on path 0
// differ in the last bit): two ranks running as threads of one process, as the threads tests and
// a user with Dist::from_store do, then compute different values in their first step, and a run
// stops being repeatable bit for bit. It showed as CollectiveOrder.CheckChangesNothingInAHealthyRun
// failing in CI with every shard different; on a CPU where MKL takes its generic path the raw
// value and the path are both 0 and nothing shows. One call before any rank computes settles it;
// the other ranks of the process wait in call_once until it has. (MKL's own CPU detection, which
// its GEMM uses, takes a lock; one product is made here all the same, so that no first-use set-up
// of the BLAS runs in two ranks at once either.)
void settle_math_library() {
  static std::once_flag once;
  std::call_once(once, [] {
    const at::Tensor x = at::full({2, 2}, 0.5, at::kFloat);
    (void)at::tanh(x);
    (void)at::mm(x, x);
  });
}

Dist::Dist(DistEnv env, c10::intrusive_ptr<c10d::Store> store, const InitOptions& options)
    : env_(std::move(env)),
      rank_(env_.rank),
      world_size_(env_.world_size),
      options_(options),
      device_(resolve_device(options)),
      store_(std::move(store)) {}

Dist::~Dist() = default;

std::shared_ptr<Dist> Dist::single(const InitOptions& options) {
  settle_math_library();  // Note [The math library's first call]
  auto dist = std::shared_ptr<Dist>(new Dist(DistEnv{}, c10::make_intrusive<c10d::HashStore>(), options));
  std::vector<int> ranks{0};
  dist->world_ = make_group(dist->store_, 0, 1, ranks, "world", options, "");
  return dist;
}

std::shared_ptr<Dist> Dist::from_store(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                       const InitOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw ConfigError("fsdp: Dist::from_store: rank " + std::to_string(rank) + " is not in [0, " +
                      std::to_string(world_size) + ")");
  }
  settle_math_library();  // Note [The math library's first call]
  DistEnv env;
  env.rank = rank;
  env.world_size = world_size;
  env.local_rank = rank;
  env.local_world_size = world_size;
  env.launcher = "store";
  auto dist = std::shared_ptr<Dist>(new Dist(env, std::move(store), options));
  std::vector<int> ranks;
  for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  join_check(*dist->store_, rank, world_size, options.timeout());
  dist->world_ = make_group(dist->store_, rank, world_size, ranks, "world", options, "127.0.0.1");
  return dist;
}

std::shared_ptr<Communicator> Dist::new_group(const std::vector<int>& ranks, const std::string& name) {
  int group_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0 && ranks[i] <= ranks[i - 1]) {
      throw ConfigError("fsdp: new_group '" + name + "': ranks must be ascending and distinct");
    }
    if (ranks[i] < 0 || ranks[i] >= world_size_) {
      throw ConfigError("fsdp: new_group '" + name + "': rank " + std::to_string(ranks[i]) +
                        " is not in the world of size " + std::to_string(world_size_));
    }
    if (ranks[i] == rank_) group_rank = static_cast<int>(i);
  }
  if (group_rank < 0) {
    throw ConfigError("fsdp: new_group '" + name + "': rank " + std::to_string(rank_) +
                      " is not a member; only members create a group");
  }
  return make_group(store_, group_rank, static_cast<int>(ranks.size()), ranks, name, options_, gloo_host());
}

std::string Dist::gloo_host() const {
  return env_.launcher == "store" || is_loopback(env_.master_addr) ? "127.0.0.1" : "";
}

Communicator& Dist::side_group(const std::string& name) {
  auto it = side_groups_.find(name);
  if (it != side_groups_.end()) return *it->second;
  std::vector<int> all;
  for (int r = 0; r < world_size_; ++r) all.push_back(r);
  // Over Gloo whatever the compute device: side work passes host tensors, and a second NCCL
  // communicator running beside training's, in no agreed order across ranks, can deadlock.
  InitOptions host_options = options_;
  host_options.device("cpu");
  auto group = make_group(store_, rank_, world_size_, all, "side/" + name, host_options, gloo_host());
  side_groups_.emplace(name, group);
  return *group;
}

void check_options(const InitOptions& options) {
  if (options.timeout().count() <= 0) {
    throw ConfigError("fsdp: InitOptions::timeout must be positive, got " + std::to_string(options.timeout().count()) +
                      " ms");
  }
}

std::shared_ptr<Dist> init_process_group(const DistEnv& env, const InitOptions& options) {
  check_options(options);
  base::tune_host_malloc();  // Note [Host malloc settings]
  if (env.world_size == 1) {
    auto dist = Dist::single(options);
    dist->env_ = env;
    return dist;
  }
  settle_math_library();  // Note [The math library's first call]
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  c10::intrusive_ptr<c10d::Store> store = open_store(env, options);
  auto dist = std::shared_ptr<Dist>(new Dist(env, store, options));
  try {
    join_check(*store, env.rank, env.world_size, options.timeout());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DistError(
        "fsdp: rendezvous on " + where + " failed on rank " + std::to_string(env.rank) +
        (env.rank == 0 || env.agent_store ? ": " : ": lost the store hosted by rank 0 (did rank 0 exit?): ") +
        first_line(e));
  }
  std::vector<int> ranks;
  for (int r = 0; r < env.world_size; ++r) ranks.push_back(r);
  const std::string host = is_loopback(env.master_addr) ? "127.0.0.1" : "";
  dist->world_ = make_group(store, env.rank, env.world_size, ranks, "world", options, host);
  return dist;
}

std::shared_ptr<Dist> init_from_env(const InitOptions& options) {
  return init_process_group(parse_dist_env(), options);
}

}  // namespace fsdp
