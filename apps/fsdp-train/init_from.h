// fsdp-train --init-from HF_DIR: a Hugging Face model directory as the run's starting point. Its
// config.json gives the model section (family and shape; models/llama/hf.h) and its safetensors
// files the weights, read by every rank straight into its own shards (fsdp::checkpoint::
// import_weights). Kept apart from the config and the trainer so that the two meet in two calls.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/fully_shard.h"

namespace train {

// The config document with its "model" section replaced by DIR/config.json's model. Only
// model.attn_implementation (a runtime choice, not part of the checkpoint's weights) may be set
// besides, in `doc` or in `overrides`; any other model key is refused by name, since it would
// contradict the weights. Throws std::invalid_argument naming the file or key.
nlohmann::json with_hf_model(const std::string& hf_dir, nlohmann::json doc,
                             const std::vector<std::pair<std::string, std::string>>& overrides);

// Reads the weights of HF_DIR into the sharded model (collective) and, on rank 0, prints one line:
// files, tensors, source dtypes and what this rank read.
void import_hf_weights(const std::string& hf_dir, fsdp::FSDPModule& root, int rank);

}  // namespace train
