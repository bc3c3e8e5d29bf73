// fsdp-train --init-from HF_DIR: a Hugging Face model directory as the run's starting point. Its
// config.json gives the model section (family and shape; models/llama/hf.h) and its safetensors
// files the weights, read by every rank straight into its own shards (fsdp::checkpoint::
// import_weights). Kept apart from the config and the trainer so that the two meet in two calls.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/fully_shard.h"

namespace train {

// The config document with its "model" section replaced by DIR/config.json's model. Only
// model.attn_implementation (a runtime choice, not part of the checkpoint's weights) and
// model.vocab_size (a larger vocabulary, see check_hf_vocab) may be set besides, in `doc` or in
// `overrides`; any other model key is refused by name, since it would contradict the weights.
// Throws std::invalid_argument naming the file or key.
nlohmann::json with_hf_model(const std::string& hf_dir, nlohmann::json doc,
                             const std::vector<std::pair<std::string, std::string>>& overrides);

// model.vocab_size against HF_DIR's: equal, or larger (the embedding and an untied LM head grow,
// Note [Grown rows] in fsdp/checkpoint.h). Throws std::invalid_argument when it is smaller: rows
// of trained tokens would be dropped.
void check_hf_vocab(const std::string& hf_dir, int64_t vocab_size);

// Reads the weights of HF_DIR into the sharded model (collective), growing the embedding and the
// LM head to vocab_size when it is larger than HF_DIR's, and, on rank 0, prints what it read (and
// grew). Returns what a checkpoint records of it (init_from_record).
// `select`: only these tensors (fsdp::checkpoint::ImportOptions::select; null: all).
nlohmann::json import_hf_weights(const std::string& hf_dir, fsdp::FSDPModule& root, int rank, int64_t vocab_size,
                                 std::function<bool(const std::string&)> select = nullptr, bool codes_in_place = true);

// TrainState.extra.init_from: {"dir": HF_DIR made absolute, "vocab_size": HF_DIR's, "model_vocab_size":
// the run's}. fsdp-ckpt export copies the tokenizer and generation files from "dir".
nlohmann::json init_from_record(const std::string& hf_dir, int64_t vocab_size);
// HF_DIR's config.json (or HF_DIR itself, a .json file) has a quantization_config (a bitsandbytes
// 4-bit save: read_hf_config refuses others).
bool bnb_4bit_source(const std::string& hf_dir);

}  // namespace train
