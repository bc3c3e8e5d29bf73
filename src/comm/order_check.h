// The collective-order check: Note [Collective-order check] in src/comm/communicator.cpp.
#pragma once

#include <cstdint>
#include <string>

#include "comm/communicator_impl.h"
#include "comm/transport.h"
#include "fsdp/errors.h"

namespace fsdp {

// Ranks disagree on the collective: no peer failed, so none is blamed.
class OrderMismatch : public DistError {
 public:
  using DistError::DistError;
};

// The collective a rank is about to run, as the check compares it.
struct OrderProbe {
  int64_t seq = 0;  // collectives run so far on this communicator
  CollectiveKind kind = CollectiveKind::kAllGather;
  uint64_t bytes = 0;  // payload bytes of this rank's input
  int dtype = -1;      // at::ScalarType of the payload; -1 for none
  std::string tag;
  std::string description;  // "reduce_scatter 'layers.0' on rank 1 of 2 (group 'world')"
};

// Exchanges `probe` with every rank of `transport` (rank `rank` of `size`) before the payload
// moves. Throws OrderMismatch naming each rank's op and tag when they differ, or TimeoutError
// naming the ranks that never reached this collective (from options.order_lookup) when the
// exchange fails.
void check_collective_order(Transport& transport, const CommunicatorOptions& options, int rank, int size,
                            const OrderProbe& probe);

}  // namespace fsdp
