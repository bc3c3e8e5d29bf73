#include "support/state.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

#include "base/file_io.h"
#include "fsdp/fully_shard.h"
#include "fsdp/optim.h"
#include "shard/testing.h"

namespace fsdp::testing {
namespace {

void append_bytes(std::ostringstream& s, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  s.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

}  // namespace

std::map<std::string, std::string> snapshot_files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& name : io::list_dir(dir)) {
    std::ifstream in(io::join(dir, name), std::ios::binary);
    out[name] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

std::string state_bytes(const std::vector<double>& losses, FSDPModule& root, ShardedOptimizer* optim) {
  std::ostringstream s;
  for (double l : losses) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%a\n", l);
    s << buf;
  }
  // states() first: it waits for the writes the last step left draining into the disk tier, which
  // the master shards below are read around (straight through their mappings).
  if (optim != nullptr) optim->states();
  for (const auto& unit : fsdp::testing::units(root)) {
    for (auto& fp : unit->flat_params()) append_bytes(s, fp->sharded_param());
  }
  if (optim != nullptr) {
    for (auto& st : optim->states()) {
      s << st.step;
      for (const auto& [name, t] : st.tensors) append_bytes(s, t);
    }
  }
  return s.str();
}

}  // namespace fsdp::testing
