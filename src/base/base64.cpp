// See base64.h.
#include "base/base64.h"

#include "fsdp/errors.h"

namespace fsdp::base {
namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

std::string base64_encode(const uint8_t* data, size_t n) {
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = static_cast<uint32_t>(data[i]) << 16;
    if (i + 1 < n) v |= static_cast<uint32_t>(data[i + 1]) << 8;
    if (i + 2 < n) v |= data[i + 2];
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < n ? kAlphabet[(v >> 6) & 63] : '=';
    out += i + 2 < n ? kAlphabet[v & 63] : '=';
  }
  return out;
}

std::vector<uint8_t> base64_decode(const std::string& text) {
  auto value = [&](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    throw CheckpointError("fsdp: train_state.json: an RNG state is not valid base64");
  };
  if (text.size() % 4 != 0) throw CheckpointError("fsdp: train_state.json: an RNG state is not valid base64");
  std::vector<uint8_t> out;
  for (size_t i = 0; i < text.size(); i += 4) {
    const int pad = (text[i + 2] == '=') + (text[i + 3] == '=');
    uint32_t v = (value(text[i]) << 18) | (value(text[i + 1]) << 12);
    if (pad < 2) v |= value(text[i + 2]) << 6;
    if (pad < 1) v |= value(text[i + 3]);
    out.push_back((v >> 16) & 255);
    if (pad < 2) out.push_back((v >> 8) & 255);
    if (pad < 1) out.push_back(v & 255);
  }
  return out;
}

}  // namespace fsdp::base
