// A safetensors file set on disk: an index (`model.safetensors.index.json`, index.h) and the
// validated header of every file it names, or a lone safetensors file standing for one. The one
// reader of a file set: the checkpoint's load and import and fsdp-ckpt open theirs through it.
// POSIX file helpers only (base/file_io.h), no LibTorch.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "safetensors/index.h"
#include "safetensors/safetensors.h"

namespace fsdp {
namespace safetensors {

struct FileSet {
  Index index;
  std::map<std::string, Header> headers;  // by file name
};

// Parses dir/index_name (parse_index), reads the header of every file it names (read_header) and
// cross-checks the two (check_index_against_headers, naming `dir`); nullopt when dir has no
// index_name. `label` names the index when a file it lists does not exist: "<label> lists <file>,
// which does not exist". Throws CheckpointError.
std::optional<FileSet> read_file_set(const std::string& dir, const std::string& index_name, const std::string& label);

// The lone file dir/file as a file set: its header, and an index that maps each of its tensors
// to it. Throws CheckpointError.
FileSet read_single_file(const std::string& dir, const std::string& file);

// A model's weights as a Hugging Face directory holds them: dir/<file>.index.json and its files
// when that index exists (read_file_set, with `label`), else the lone dir/<file>; nullopt when
// dir has neither.
std::optional<FileSet> read_index_or_file(const std::string& dir, const std::string& file, const std::string& label);

}  // namespace safetensors
}  // namespace fsdp
