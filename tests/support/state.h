// Byte-exact views of training state, for tests that compare runs bit for bit.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace fsdp {
class FSDPModule;
class ShardedOptimizer;
}  // namespace fsdp

namespace fsdp::testing {

// The bytes of every file directly under `dir`, by name.
std::map<std::string, std::string> snapshot_files(const std::string& dir);

// Losses (hex floats, exact), then this rank's master shards and, with `optim`, its steps and
// state tensors, as bytes: equal strings mean bitwise-equal training.
std::string state_bytes(const std::vector<double>& losses, FSDPModule& root, ShardedOptimizer* optim = nullptr);

}  // namespace fsdp::testing
