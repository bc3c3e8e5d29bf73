// The layout of a token file, parsed from its bytes: which bytes hold tokens, how wide each is,
// and whether every id fits the model's vocabulary. No file access and no LibTorch here, so the
// checks run on any byte string (tests, a fuzz target) exactly as on a mapped file.
//
// Formats (see data.h): a `.bin` file holds little-endian tokens of data.token_dtype ("uint16" or
// "uint32"), raw (nanoGPT) or behind llm.c's 1024-byte header (version 1: uint16, version 2:
// uint32, which must agree with data.token_dtype); any other file is raw bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "named.h"

namespace train {

struct TokenLayout {
  std::string format;  // for messages: "uint16 tokens", "llm.c, uint32 tokens", "raw bytes"
  int width = 1;       // bytes per token: 1, 2 or 4
  size_t offset = 0;   // where the first token starts
  int64_t count = 0;   // tokens in the file
};

// Token `i` of a layout (little-endian on disk, whatever the host).
inline int64_t token_at(const unsigned char* data, const TokenLayout& layout, int64_t i) {
  const unsigned char* p = data + layout.offset + static_cast<size_t>(i) * static_cast<size_t>(layout.width);
  uint64_t v = 0;
  for (int b = layout.width - 1; b >= 0; --b) v = (v << 8) | p[b];
  return static_cast<int64_t>(v);
}

// Bytes per token: 2 or 4.
int token_width(TokenDtype token_dtype);

// The layout of `size` bytes of the file `label` names in errors ("data file 'x.bin'"). `bin` selects the token
// formats (else raw bytes). Throws std::invalid_argument naming the file and, where the fix is
// there, `dtype_field` (e.g. "data.token_dtype"): a size that is not a multiple of the token width,
// an llm.c header that disagrees with token_dtype or with the file's size, or uint32 tokens read
// as uint16 (every second uint16 zero).
TokenLayout parse_token_layout(const unsigned char* data, size_t size, const std::string& label, bool bin,
                               TokenDtype token_dtype, const std::string& dtype_field);

// One pass over every token: throws std::invalid_argument naming the file, the first id >= vocab,
// its position, the largest id and the fix (model.vocab_size, or `dtype_field` when the ids look
// like uint16 tokens read as uint32).
void check_token_ids(const unsigned char* data, const TokenLayout& layout, int64_t vocab, const std::string& label,
                     const std::string& dtype_field);

}  // namespace train
