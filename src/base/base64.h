// Base64 (RFC 4648, with padding): the per-rank RNG states in train_state.json are stored so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::base {

std::string base64_encode(const uint8_t* data, size_t n);
// Throws CheckpointError for text that is not valid base64 (the only use reads checkpoints).
std::vector<uint8_t> base64_decode(const std::string& text);

}  // namespace fsdp::base
