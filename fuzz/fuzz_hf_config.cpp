// libFuzzer target: a Hugging Face config.json (models/llama/hf.cpp, config_from_hf_json), the
// file fsdp-train --init-from and fsdp::checkpoint import read first. The input is the file's
// text. Besides the sanitizers' findings, a crash is: an exception other than
// std::invalid_argument, an accepted config that fails LlamaConfig::validate, or one that does
// not come back unchanged through hf_config_json -> config_from_hf_json.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "hf.h"
#include "llama.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  llama::LlamaConfig config;
  try {
    config = llama::hf::config_from_hf_json(text, "fuzz/config.json");
  } catch (const std::invalid_argument&) {
    return 0;
  }
  try {
    config.validate();
  } catch (const std::invalid_argument&) {
    std::abort();  // accepted but invalid
  }
  const nlohmann::json out = llama::hf::hf_config_json(config, config.dtype);
  llama::LlamaConfig again;
  try {
    again = llama::hf::config_from_hf_json(out.dump(), "fuzz/config.json (written back)");
  } catch (const std::invalid_argument&) {
    std::abort();  // what we write, we must read
  }
  again.attn_implementation = config.attn_implementation;
  require(again.to_json() == config.to_json());
  return 0;
}
