// frozen_storage_tool: a small command line over src/frozen/frozen_storage, so that
// tests/interop/frozen_storage_test.py can check the quantized stored form of frozen parameters bit
// for bit against a numpy reference of Note [Frozen storage] and, for NF4, against bitsandbytes.
//   frozen_storage_tool STORAGE IN.f32 OUT_PREFIX
//     STORAGE     int8 or nf4 (parse_frozen_storage's names)
//     IN.f32      raw little-endian float32 values, a multiple of 64 of them
//     OUT_PREFIX  writes OUT_PREFIX.stored, the bytes of encode(STORAGE, values) ([codes | absmax
//                 as fp32 bytes]), and OUT_PREFIX.decoded, decode of those bytes as raw float32
// Errors go to stderr with exit status 2.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "fsdp/errors.h"
#include "fsdp/options.h"
#include "frozen/frozen_storage.h"

namespace {

using fsdp::ConfigError;

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("frozen_storage_tool: cannot open " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw ConfigError("frozen_storage_tool: cannot read " + path);
  return bytes;
}

void write_file(const std::string& path, const at::Tensor& t) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(t.const_data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  out.close();
  if (!out) throw ConfigError("frozen_storage_tool: cannot write " + path);
}

int run(const std::string& storage, const std::string& in_path, const std::string& prefix) {
  const fsdp::FrozenStorage s = fsdp::parse_frozen_storage(storage);
  if (!fsdp::frozen::quantized(s)) {
    throw ConfigError("frozen_storage_tool: storage '" + storage + "' is not quantized (expected int8 or nf4)");
  }
  std::vector<char> bytes = read_file(in_path);
  if (bytes.size() % sizeof(float) != 0) {
    throw ConfigError("frozen_storage_tool: " + in_path + " holds " + std::to_string(bytes.size()) +
                      " bytes, not a whole number of float32 values");
  }
  const int64_t n = static_cast<int64_t>(bytes.size() / sizeof(float));
  const at::Tensor values = at::from_blob(bytes.data(), {n}, at::kFloat);
  const at::Tensor stored = fsdp::frozen::encode(s, values).contiguous();
  if (stored.scalar_type() != at::kByte || stored.dim() != 1 || stored.numel() != fsdp::frozen::stored_numel(s, n)) {
    throw ConfigError("frozen_storage_tool: encode returned " + std::to_string(stored.numel()) +
                      " elements, expected " + std::to_string(fsdp::frozen::stored_numel(s, n)) + " bytes");
  }
  const at::Tensor decoded = at::empty({n}, at::kFloat);
  fsdp::frozen::decode(s, stored, decoded);
  write_file(prefix + ".stored", stored);
  write_file(prefix + ".decoded", decoded);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  if (argc != 4) {
    std::fprintf(stderr, "usage: frozen_storage_tool int8|nf4 IN.f32 OUT_PREFIX\n");
    return 2;
  }
  try {
    return run(argv[1], argv[2], argv[3]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
