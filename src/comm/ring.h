// The CPU ring transport's construction, shared by its factory (cpu_transport.cpp, which decides
// each hop's kind with the other ranks) and ring.cpp (the collectives).
#pragma once

#include <memory>

#include "comm/shm_channel.h"
#include "comm/transport.h"

namespace fsdp {

// How this rank's two ring hops travel. Every rank of the group must be given the same `layout`.
struct RingHops {
  enum class Layout {
    kGloo,   // every hop over Gloo (the segmented send/recv ring)
    kShm,    // every hop in shared memory (one host): no Gloo process group at all
    kMixed,  // some hops in shared memory, some over Gloo: one Gloo message per ring step
  };
  Layout layout = Layout::kGloo;
  std::unique_ptr<ShmChannel> in;   // from the previous rank, when that hop is shared memory
  std::unique_ptr<ShmChannel> out;  // to the next rank, when that hop is shared memory
};

std::unique_ptr<Transport> make_ring_transport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               const CpuTransportOptions& options, RingHops hops);

}  // namespace fsdp
