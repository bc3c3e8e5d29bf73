// A one-rank group: a communicator whose only member is this rank, for the places that need a
// group of their own but share nothing (a NO_SHARD unit's shard group, a 1-D mesh's replicate
// group). Its collectives are local copies; they still count and trace like any other group's.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "fsdp/comm.h"

namespace fsdp {

// `name` shows in errors ("group 'no_shard/3'"); `global_rank` is this rank's place in the world.
std::shared_ptr<Communicator> make_self_group(const std::string& name, int global_rank,
                                              std::chrono::milliseconds timeout = CommunicatorOptions().timeout);

}  // namespace fsdp
