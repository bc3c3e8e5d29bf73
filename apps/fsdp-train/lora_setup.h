// The lora section's part of a run (config.h, LoraConfig): the adapters added to the model before
// it is sharded, a PEFT adapter to start from, and what a resume checks.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "config.h"
#include "fsdp/fully_shard.h"
#include "fsdp/lora.h"
#include "llama.h"

namespace train {

// fsdp::lora on the model with the section's options; its errors name the config keys.
fsdp::LoraModel apply_lora(llama::LlamaForCausalLM& model, const LoraConfig& cfg, uint64_t seed);

// Reads the PEFT adapter in `dir` (adapter_config.json, adapter_model.safetensors) into the
// sharded model's adapters (collective). Its r, lora_alpha and target_modules must be the
// section's, and its tensors the model's adapters with their shapes: an adapter made for another
// base model is refused naming what differs. Rank 0 prints what it read.
void load_peft_adapter(const std::string& dir, fsdp::FSDPModule& root, const LoraConfig& cfg, int rank);

// Before a resume: the checkpoint's lora section (extra.config.lora) against this run's. A LoRA
// checkpoint resumed without LoRA (or the reverse, or with another r or other targets) is refused
// naming both.
void check_lora_resume(const nlohmann::json& saved_extra, const LoraConfig& now, const std::string& checkpoint);

// Whether a checkpoint saved by this run's lora section holds the frozen base (lora.save_base).
bool holds_base(const nlohmann::json& saved_extra);

}  // namespace train
