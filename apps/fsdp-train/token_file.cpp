// Token file layouts and id checks, from bytes alone. See token_file.h.
#include "token_file.h"

#include <algorithm>
#include <stdexcept>

namespace train {
namespace {

// llm.c's .bin header: 256 int32, [0] magic, [1] version (1: uint16 tokens, 2: uint32), [2] count.
constexpr int32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeaderBytes = 256 * 4;
// uint32 tokens read as uint16 show as every second uint16 being zero; below this many tokens the
// pattern is too weak a sign to refuse a file for.
constexpr int64_t kMinTokensForWidthCheck = 64;

[[noreturn]] void fail(const std::string& label, const std::string& why) {
  throw std::invalid_argument(label + ": " + why);
}

int32_t read_i32(const unsigned char* d, size_t k) {
  return static_cast<int32_t>(static_cast<uint32_t>(d[4 * k]) | (static_cast<uint32_t>(d[4 * k + 1]) << 8) |
                              (static_cast<uint32_t>(d[4 * k + 2]) << 16) |
                              (static_cast<uint32_t>(d[4 * k + 3]) << 24));
}

std::string dtype_of_width(int width) { return width == 2 ? "uint16" : "uint32"; }

TokenLayout llmc_layout(const unsigned char* data, size_t size, const std::string& label, int width,
                        const std::string& dtype_field) {
  const int32_t version = read_i32(data, 1);
  if (version != 1 && version != 2) {
    fail(label, "has llm.c's header with version " + std::to_string(version) + " (expected 1 or 2)");
  }
  TokenLayout l;
  l.width = version == 1 ? 2 : 4;
  if (l.width != width) {
    fail(label, "has llm.c's header for " + dtype_of_width(l.width) + " tokens (version " + std::to_string(version) +
                    ") but " + dtype_field + "=\"" + dtype_of_width(width) + "\"; set " + dtype_field + "=\"" +
                    dtype_of_width(l.width) + "\"");
  }
  l.format = "llm.c, " + dtype_of_width(l.width) + " tokens";
  l.offset = kLlmcHeaderBytes;
  l.count = read_i32(data, 2);
  const size_t need = kLlmcHeaderBytes + static_cast<size_t>(std::max<int64_t>(l.count, 0)) * l.width;
  if (l.count < 0 || need != size) {
    fail(label, "llm.c header says " + std::to_string(l.count) + " tokens, which needs " + std::to_string(need) +
                    " bytes, but the file has " + std::to_string(size));
  }
  return l;
}

// Raw uint16 tokens whose every second value is zero while the others are not: the little-endian
// uint32 tokens of a vocabulary below 65,536, read at the wrong width.
bool looks_like_uint32(const unsigned char* data, const TokenLayout& l) {
  if (l.width != 2 || l.count < kMinTokensForWidthCheck || l.count % 2 != 0) return false;
  bool any_low = false;
  for (int64_t i = 0; i < l.count; i += 2) {
    if (token_at(data, l, i + 1) != 0) return false;
    any_low = any_low || token_at(data, l, i) != 0;
  }
  return any_low;
}

}  // namespace

int token_width(TokenDtype token_dtype) { return token_dtype == TokenDtype::kUint32 ? 4 : 2; }

TokenLayout parse_token_layout(const unsigned char* data, size_t size, const std::string& label, bool bin,
                               TokenDtype token_dtype, const std::string& dtype_field) {
  TokenLayout l;
  if (!bin) {
    l.format = "raw bytes";
    l.count = static_cast<int64_t>(size);
    return l;
  }
  const int width = token_width(token_dtype);
  const std::string dtype = name_of(kTokenDtypes, token_dtype);
  if (size >= kLlmcHeaderBytes && read_i32(data, 0) == kLlmcMagic)
    return llmc_layout(data, size, label, width, dtype_field);
  l.width = width;
  l.format = dtype + " tokens";
  if (size % static_cast<size_t>(width) != 0) {
    fail(label, "has " + std::to_string(size) + " bytes, not a multiple of " + std::to_string(width) + " (" +
                    dtype_field + "=\"" + dtype + "\"): a truncated file, or tokens of another width" +
                    (width == 4 ? "; for uint16 tokens set " + dtype_field + "=\"uint16\"" : ""));
  }
  l.count = static_cast<int64_t>(size / static_cast<size_t>(width));
  if (looks_like_uint32(data, l)) {
    fail(label, "every second uint16 is 0: it holds uint32 tokens, but " + dtype_field + "=\"uint16\"; set " +
                    dtype_field + "=\"uint32\"");
  }
  return l;
}

void check_token_ids(const unsigned char* data, const TokenLayout& l, int64_t vocab, const std::string& label,
                     const std::string& dtype_field) {
  if (l.width < 8 && vocab >= (int64_t{1} << (8 * l.width))) return;  // no id of this width can be too big
  for (int64_t i = 0; i < l.count; ++i) {
    const int64_t t = token_at(data, l, i);
    if (t < vocab) continue;
    int64_t max = t;
    for (int64_t j = i + 1; j < l.count; ++j) max = std::max(max, token_at(data, l, j));
    std::string fix = "set model.vocab_size to at least " + std::to_string(max + 1);
    // uint16 tokens read as uint32 pair up into ids of 65,536 and more.
    if (l.width == 4 && max >= 65536 && vocab <= 65536) {
      fix += ", or, if the file holds uint16 tokens, set " + dtype_field + "=\"uint16\"";
    }
    fail(label, "token id " + std::to_string(t) + " at position " + std::to_string(i) + " is >= model.vocab_size=" +
                    std::to_string(vocab) + " (the largest id is " + std::to_string(max) + "); " + fix);
  }
}

}  // namespace train
