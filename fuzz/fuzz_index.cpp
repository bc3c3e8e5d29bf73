// libFuzzer target: the input is the text of a model.safetensors.index.json. Besides the
// sanitizers' findings, a crash is: an exception other than CheckpointError, an accepted index
// with an unsafe file name, or one that index_to_json -> parse_index does not reproduce exactly.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "safetensors/index.h"
#include "fsdp/errors.h"

namespace st = fsdp::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  st::Index index;
  try {
    index = st::parse_index("fuzz.index.json", text);
  } catch (const fsdp::CheckpointError&) {
    return 0;
  }
  for (const auto& kv : index.weight_map) {
    const std::string& f = kv.second;
    if (f.empty() || f == "." || f == ".." || f.find_first_of(std::string("/\\\0", 3)) != std::string::npos) {
      std::abort();
    }
  }
  const std::string once = st::index_to_json(index);
  const st::Index back = st::parse_index("fuzz.index.json (rewritten)", once);
  if (back.weight_map != index.weight_map || back.metadata != index.metadata) std::abort();
  if (st::index_to_json(back) != once) std::abort();
  return 0;
}
