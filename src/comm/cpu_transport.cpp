// make_cpu_transport: the ranks of a group agree, through the store, on which of their ring's hops
// stay on one host, set up a shared-memory channel for each of those, and build the ring.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "base/strings.h"
#include "comm/ring.h"
#include "comm/shm_channel.h"
#include "comm/transport.h"

namespace fsdp {
namespace {

std::string get_text(c10d::Store& store, const std::string& key) {
  const auto raw = store.get(key);
  return std::string(raw.begin(), raw.end());
}

void set_text(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string resolve_mode(const CpuTransportOptions& options) {
  std::string mode = options.mode;
  if (const char* env = std::getenv("FSDP_CPU_TRANSPORT"); env != nullptr && *env != '\0') mode = env;
  if (mode != "auto" && mode != "gloo") {
    throw ConfigError(
        "fsdp: the CPU transport must be \"auto\" (shared memory within a host, Gloo between hosts) or "
        "\"gloo\", got \"" +
        mode + "\" (InitOptions::cpu_transport or FSDP_CPU_TRANSPORT)");
  }
  return mode;
}

std::string resolve_host_id(const CpuTransportOptions& options) {
  if (const char* env = std::getenv("FSDP_HOST_ID"); env != nullptr && *env != '\0') return shm_host_key(env);
  return shm_host_key(options.host_id);
}

// This rank's half of the channel set-up: it creates the segment of its incoming hop and opens
// the one of its outgoing hop. Each outcome is posted, failures included, so that no rank waits
// for a key that a failed peer never writes; returns this rank's error, or "".
std::string connect_hops(c10d::Store& store, int rank, int size, bool in_shm, bool out_shm, RingHops& hops) {
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  std::string error;
  if (in_shm) {
    try {
      hops.in = ShmChannel::create("r" + std::to_string(rank), prev, rank);
      set_text(store, "shm/" + std::to_string(rank), "ok " + hops.in->name());
    } catch (const std::exception& e) {
      error = base::first_line(e);
      set_text(store, "shm/" + std::to_string(rank), "error " + error);
    }
  }
  if (out_shm) {
    const std::string posted = get_text(store, "shm/" + std::to_string(next));
    std::string outcome = "ok";
    if (posted.rfind("ok ", 0) != 0) {
      outcome = "error rank " + std::to_string(next) + " failed";
      if (error.empty()) error = "rank " + std::to_string(next) + " could not create its segment: " + posted.substr(6);
    } else {
      try {
        hops.out = ShmChannel::open(posted.substr(3), next, rank);
      } catch (const std::exception& e) {
        outcome = "error " + base::first_line(e);
        if (error.empty()) error = base::first_line(e);
      }
    }
    set_text(store, "opened/" + std::to_string(next), outcome);
  }
  if (hops.in) {
    const std::string opened = get_text(store, "opened/" + std::to_string(rank));
    hops.in->unlink();  // both ends have it mapped (or never will): the name is no longer needed
    if (opened != "ok" && error.empty()) {
      error = "rank " + std::to_string(prev) + " could not map this rank's segment: " + opened.substr(6);
    }
  }
  return error;
}

// Every rank posts whether its set-up worked and reads everyone's, so all ranks take the same
// decision. Returns the first failure, "rank R: message", or "" when every rank succeeded.
std::string agree(c10d::Store& store, int rank, int size, const std::string& my_error) {
  set_text(store, "status/" + std::to_string(rank), my_error.empty() ? "ok" : my_error);
  std::string first;
  for (int r = 0; r < size; ++r) {
    const std::string status = get_text(store, "status/" + std::to_string(r));
    if (status != "ok" && first.empty()) first = "rank " + std::to_string(r) + ": " + status;
  }
  return first;
}

}  // namespace

std::unique_ptr<Transport> make_cpu_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              const CpuTransportOptions& options) {
  if (resolve_mode(options) == "gloo") return make_ring_transport(store, rank, size, options, RingHops{});
  // A group made again under the same name (same store prefix) must not read the keys of the
  // earlier one: every rank counts its own makings, and all ranks make groups in the same order.
  const int64_t generation = store->add("cpu/made/" + std::to_string(rank), 1);
  auto keys = c10::make_intrusive<c10d::PrefixStore>("cpu/" + std::to_string(generation), store);
  set_text(*keys, "host/" + std::to_string(rank), resolve_host_id(options));
  std::vector<std::string> hosts(size);
  for (int r = 0; r < size; ++r) hosts[r] = get_text(*keys, "host/" + std::to_string(r));
  bool all_one_host = true, any_local_hop = false;
  for (int r = 0; r < size; ++r) {
    all_one_host = all_one_host && hosts[r] == hosts[0];
    any_local_hop = any_local_hop || hosts[r] == hosts[(r + 1) % size];
  }
  RingHops hops;
  if (!any_local_hop) return make_ring_transport(store, rank, size, options, std::move(hops));
  hops.layout = all_one_host ? RingHops::Layout::kShm : RingHops::Layout::kMixed;
  static std::once_flag cleaned;
  std::call_once(cleaned, [] { remove_stale_shm_segments(); });
  const bool in_shm = hosts[(rank + size - 1) % size] == hosts[rank];
  const bool out_shm = hosts[(rank + 1) % size] == hosts[rank];
  const std::string failure = agree(*keys, rank, size, connect_hops(*keys, rank, size, in_shm, out_shm, hops));
  if (!failure.empty()) {
    // Every rank saw the same failure: the whole group runs over Gloo instead (slower, correct).
    TORCH_WARN("fsdp: shared memory between the ranks of a host could not be set up (", failure,
               "); this group's collectives go over Gloo instead. Enlarge /dev/shm (e.g. docker --shm-size) to "
               "get it back, or set FSDP_CPU_TRANSPORT=gloo to choose Gloo and silence this warning.");
    return make_ring_transport(store, rank, size, options, RingHops{});
  }
  return make_ring_transport(store, rank, size, options, std::move(hops));
}

}  // namespace fsdp
