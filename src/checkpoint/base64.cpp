// Base64 for the per-rank RNG states in train_state.json, and their capture and restore.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "checkpoint/save_job.h"
#include "fsdp/errors.h"

namespace fsdp::checkpoint {
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

std::string rng_state_base64() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor state = gen.get_state();
  return base64_encode(state.data_ptr<uint8_t>(), state.numel());
}

void restore_rng_state_base64(const std::string& text) {
  const auto bytes = base64_decode(text);
  at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(state);
  } catch (const std::exception& e) {
    throw CheckpointError(std::string("fsdp: train_state.json: cannot restore an RNG state: ") + e.what());
  }
}

}  // namespace fsdp::checkpoint
