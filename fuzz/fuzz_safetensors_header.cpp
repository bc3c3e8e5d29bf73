// libFuzzer target: the input is a whole safetensors file. The length prefix and header are split
// off as read_header does and passed to parse_header with the input's size as the file size.
// Besides the sanitizers' findings, a crash is: an exception other than CheckpointError, a header
// accepted although it breaks Note [Safetensors validation], or an accepted header that does not
// survive plan_file -> parse_header unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>

#include "safetensors/safetensors.h"
#include "fsdp/errors.h"

namespace st = fsdp::safetensors;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

void check_invariants(const st::Header& h, uint64_t file_size) {
  std::set<std::string> names;
  uint64_t covered = 0;
  for (const st::TensorEntry& e : h.tensors) {
    require(names.insert(e.name).second);
    require(e.begin == covered && e.begin <= e.end);
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      require(d >= 0);
      require(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel));
    }
    uint64_t nbytes = 0;
    require(!__builtin_mul_overflow(numel, st::itemsize(e.dtype), &nbytes));
    require(nbytes == e.nbytes());
    require(h.find(e.name) == &e);
    covered = e.end;
  }
  require(h.data_start() + covered == file_size);
}

void check_round_trip(const st::Header& h) {
  std::vector<st::TensorSpec> specs;
  for (const st::TensorEntry& e : h.tensors) specs.push_back({e.name, e.dtype, e.shape});
  const st::FilePlan plan = st::plan_file(specs, h.metadata);
  const std::string json = plan.header_bytes.substr(8);
  const st::Header back = st::parse_header("replanned", json, json.size(), plan.file_size);
  require(back.metadata == h.metadata && back.tensors.size() == h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const st::TensorEntry& a = h.tensors[i];
    const st::TensorEntry& b = back.tensors[i];
    require(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin && a.end == b.end);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* bytes = reinterpret_cast<const char*>(data);
  uint64_t header_len = 0;
  std::string json;
  if (size >= 8) {
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
    // read_header never reads a header that the length checks refuse; mirror that.
    if (header_len <= st::kMaxHeaderLen && header_len <= size - 8) json.assign(bytes + 8, header_len);
  }
  st::Header header;
  try {
    header = st::parse_header("fuzz.safetensors", json, header_len, size);
  } catch (const fsdp::CheckpointError&) {
    return 0;
  }
  check_invariants(header, size);
  check_round_trip(header);
  return 0;
}
