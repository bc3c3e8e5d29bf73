// libFuzzer target: fsdp-train's token files (apps/fsdp-train/token_file.cpp), parsed from bytes as
// the trainer parses a mapped file. The first byte picks the case: bit 0 = a `.bin` file (else raw
// bytes), bit 1 = data.token_dtype "uint32" (else "uint16"), bits 2-7 = the vocabulary size's
// power of two (clamped); the rest is the file. Besides the sanitizers' findings, a crash is: an
// exception other than std::invalid_argument, an accepted layout whose tokens lie outside the
// input, or an accepted file with a token id >= vocab.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "token_file.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const unsigned char* file = data + 1;
  const size_t bytes = size - 1;
  const bool bin = (mode & 1) != 0;
  const train::TokenDtype dtype = (mode & 2) != 0 ? train::TokenDtype::kUint32 : train::TokenDtype::kUint16;
  const int64_t vocab = int64_t{1} << std::min(33, 1 + (mode >> 2));
  train::TokenLayout layout;
  try {
    layout = train::parse_token_layout(file, bytes, "data file 'fuzz.bin'", bin, dtype, "data.token_dtype");
  } catch (const std::invalid_argument&) {
    return 0;
  }
  require(layout.width == 1 || layout.width == 2 || layout.width == 4);
  require(layout.count >= 0);
  require(layout.offset <= bytes);
  require(static_cast<uint64_t>(layout.count) * static_cast<uint64_t>(layout.width) <= bytes - layout.offset);
  try {
    train::check_token_ids(file, layout, vocab, "data file 'fuzz.bin'", "data.token_dtype");
  } catch (const std::invalid_argument&) {
    return 0;
  }
  for (int64_t i = 0; i < layout.count; ++i) require(train::token_at(file, layout, i) < vocab);
  return 0;
}
