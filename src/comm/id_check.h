// The identity check in the communicator's queue, for transports whose messages cannot carry a
// collective's identity (NCCL): Note [Identity check in the queue] in id_check.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace fsdp {

class QueueIdCheck {
 public:
  static constexpr int kWindow = 64;  // identities per exchange, at most

  QueueIdCheck(int rank, int size, std::string group, int every = kWindow);
  // Records the collective about to run; true when the window is full and must be checked before
  // that collective runs.
  bool record(const CollectiveId& id);
  bool empty() const { return window_.empty(); }
  // Exchanges the window with every rank of `transport` and empties it. Throws OrderMismatch
  // naming each rank's collective at the first position where they differ.
  void check(Transport& transport, uint64_t seq);

 private:
  int rank_;
  int size_;
  std::string group_;
  int every_;
  std::vector<WireId> window_;
};

}  // namespace fsdp
