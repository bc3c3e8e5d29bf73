// The index of a checkpoint split over several safetensors files, in the usual
// `model.safetensors.index.json` shape: {"metadata": {...}, "weight_map": {tensor: file}}. Any
// Hugging Face tool that loads sharded checkpoints reads it. Parsing is strict the way headers are
// (duplicate keys refused), file names must be plain names inside the checkpoint directory, and
// check_index_against_headers cross-checks the index with what the files actually hold.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "safetensors/safetensors.h"

namespace fsdp {
namespace safetensors {

struct Index {
  nlohmann::json metadata = nlohmann::json::object();  // free-form, e.g. {"total_size": 123}
  std::map<std::string, std::string> weight_map;       // tensor name -> file name

  // The distinct file names of weight_map, sorted.
  std::vector<std::string> files() const;
};

// Parses index JSON; `label` names it in error messages (usually its path). Refuses text that is
// not a JSON object, duplicate keys at any level, nesting deeper than 64, keys other than
// "metadata" and "weight_map", a missing weight_map, a metadata that is not an object, and a
// weight_map value that is not a string or not a plain file name (see check_file_name).
// Throws CheckpointError.
Index parse_index(const std::string& label, const std::string& text);

// Pretty JSON with sorted keys: the same Index always gives the same text. Throws CheckpointError
// for a file name check_file_name refuses or text that is not valid UTF-8.
std::string index_to_json(const Index& index);

// Throws CheckpointError unless `file` is a plain file name: not empty, not "." or "..", and free
// of '/', '\\' and NUL, so that joining it to the checkpoint directory stays inside it.
// `label` and `tensor` (the weight_map key) go into the message.
void check_file_name(const std::string& label, const std::string& tensor, const std::string& file);

// Checks that `index` and the headers of its files agree. `headers_by_file` maps the file names
// of this file set that were found on disk to their headers. Throws CheckpointError, naming
// `dir_label` and the file and tensor, when a file of the index is missing from the map, a tensor
// of the index is not in its file, a tensor of a file is not in the index or is listed under
// another file, or a tensor name is held by two files.
void check_index_against_headers(const std::string& dir_label, const Index& index,
                                 const std::map<std::string, Header>& headers_by_file);

}  // namespace safetensors
}  // namespace fsdp
