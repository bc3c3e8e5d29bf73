// How the library makes communicators (include/fsdp/comm.h keeps the class's collectives public
// and its construction private): from a transport and options, or as a one-rank group. Used by
// src/comm (Dist, DeviceMesh), the layers above it and tests, never by users.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/local_group.h"
#include "comm/transport.h"
#include "fsdp/comm.h"

namespace fsdp {

struct CommunicatorOptions {
  std::string name = "world";  // shows in errors: "group 'world'"
  std::chrono::milliseconds timeout{60000};
  std::vector<int> global_ranks;  // the group's members by global rank; empty = 0..size-1
  // Debug: before every collective the ranks exchange a fingerprint (sequence number, kind, tag,
  // bytes) and fail with a mismatch naming the ranks, ops and tags instead of hanging or mixing
  // data. See Note [Collective-order check] in src/comm/communicator.cpp.
  bool check_order = false;
  // With check_order: a board shared by the ranks (the rendezvous store) where each rank posts the
  // collective it has reached, so a rank that skipped one can be named when the fingerprint
  // exchange times out. Both may be empty.
  std::function<void(const std::string& key, const std::string& value)> order_post;
  std::function<std::optional<std::string>(const std::string& key)> order_lookup;
  // The identity check in the queue (transports that cannot carry identities, or
  // FSDP_COLLECTIVE_IDS=queue): every how many collectives it runs by itself, 1 to 64.
  int id_check_every = 64;
};

// A communicator over `transport`'s ranks. Throws ConfigError when options.global_ranks does not
// have one entry per rank.
std::shared_ptr<Communicator> make_communicator(std::unique_ptr<Transport> transport, CommunicatorOptions options);

}  // namespace fsdp
