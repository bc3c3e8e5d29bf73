// The harness of the tests that train a model on thread ranks and compare runs bit for bit: each
// rank gets one intra-op thread and a 1-D mesh over every rank, trains, and hands back its
// fingerprint (testing::state_bytes: its losses and every state).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/device_mesh.h"
#include "support/ranks.h"

namespace fsdp::testing {

// Runs `rank_fn(mesh, rank)` on `world` thread ranks; returns each rank's result, by rank.
std::vector<std::string> train_ranks(int world, const std::function<std::string(DeviceMesh& mesh, int rank)>& rank_fn,
                                     std::chrono::milliseconds timeout);

}  // namespace fsdp::testing
