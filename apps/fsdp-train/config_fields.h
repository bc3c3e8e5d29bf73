// The config's field table: one row per key of the data, optim, fsdp and train sections (the model
// section is llama::LlamaConfig's own, see config.cpp), with where the value lives in TrainConfig,
// what it accepts and a line of help. The table drives parsing (TrainConfig::from_json), the dump
// (TrainConfig::to_json) and fsdp-train --help, whose defaults come from a default-constructed
// TrainConfig. Cross-field checks (data.path against data.source, min_lr against lr, ...) are code
// in config.cpp, run after their section's rows.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.h"

namespace train {

struct ConfigField {
  std::string section;  // "optim", "fsdp.offload"
  std::string key;      // "lr"
  std::string accepts;  // "number >= 0", "\"cosine\" / \"constant\""
  std::string help;     // one line
  // Reads `value` (present in the document) into `c`; throws std::invalid_argument naming the
  // dotted key and the value ("config: optim.lr=\"fast\": must be a number").
  std::function<void(TrainConfig& c, const nlohmann::json& value)> read;
  std::function<nlohmann::json(const TrainConfig& c)> write;  // the value as the dump holds it

  std::string dotted() const { return section + "." + key; }
};

// Every row, in the order keys are read and listed: data, optim, fsdp (then fsdp.offload and
// fsdp.debug), train, lora.
const std::vector<ConfigField>& config_fields();

[[noreturn]] void reject(const std::string& key, const nlohmann::json& value, const std::string& why);

// `doc`'s member `name` when it is there (an object, else rejected naming it), or null.
const nlohmann::json* section_object(const nlohmann::json& doc, const std::string& name);

// Reads the rows of `section` present in `obj` (null: none) in table order, a nested section
// (e.g. fsdp.offload) where its first row stands, calling `nested_done` after each nested section
// that is present; then refuses the first unknown key, listing the known ones.
void read_section(const nlohmann::json* obj, const std::string& section, TrainConfig& c,
                  const std::function<void(const std::string& nested)>& nested_done);

// Every row's value, nested by section ({"data": {...}, "fsdp": {"offload": {...}}, ...}).
nlohmann::json write_fields(const TrainConfig& c);

// The --help listing of every key with its default (from TrainConfig()) and its help.
std::string config_help();

}  // namespace train
