// A one-rank communicator, for the layers above that need a group of their own rank alone.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "fsdp/comm.h"

namespace fsdp {

// The one way to make a one-rank group (a single process's world, a mesh dimension of size 1,
// NO_SHARD's shard group): every collective is a local copy, run at once on the calling thread.
// `global_rank` is this process's rank in the world; `timeout` bounds its waits (CommunicatorOptions's default).
std::shared_ptr<Communicator> make_local_group(const std::string& name, int global_rank,
                                               std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

}  // namespace fsdp
