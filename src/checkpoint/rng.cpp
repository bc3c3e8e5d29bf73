// The per-rank RNG states in train_state.json: capture and restore, as base64 text.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstring>
#include <mutex>

#include "base/base64.h"
#include "checkpoint/save_job.h"
#include "fsdp/errors.h"

namespace fsdp::checkpoint {

using base::base64_decode;
using base::base64_encode;

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
