// A committed checkpoint opened read-only for fsdp-ckpt: its train_state.json and its file sets
// (model, optim.<state>), each with a validated index and headers, plus the small helpers every
// subcommand shares (reading a tensor's bytes, the Llama config stored by fsdp-train). Nothing here
// needs a process group or a sharded model.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/strings.h"
#include "safetensors/file_set.h"
#include "safetensors/safetensors.h"
#include "llama.h"

namespace fsdp_ckpt {

// Bad command-line use: main() prints it with the usage text and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where one tensor's bytes are: the file (a plain name inside the checkpoint directory), the
// absolute offset of its data in that file, and the header entry.
struct TensorLocation {
  std::string file;
  uint64_t offset = 0;
  fsdp::safetensors::TensorEntry entry;
};

// One file set: "<kind>.safetensors.index.json" and the files it names.
// Its index and headers (index, headers by file name) as safetensors::read_file_set reads them.
struct FileSet : fsdp::safetensors::FileSet {
  std::string kind;                               // "model", "optim.exp_avg", ...
  std::map<std::string, TensorLocation> tensors;  // by tensor name
  std::vector<std::string> order;                 // tensor names by (file, offset)

  std::string index_name() const { return kind + ".safetensors.index.json"; }
  uint64_t data_bytes() const;
};

struct Checkpoint {
  std::string dir;            // the resolved checkpoint directory
  nlohmann::json state;       // train_state.json as parsed, fields unchecked (see verify)
  std::vector<FileSet> sets;  // "model" first, then the others by name

  const FileSet* find(const std::string& kind) const;
  const FileSet& model() const;  // throws CheckpointError when there is no model file set
};

// A checkpoint directory, or a save root whose `latest` names one -> the committed checkpoint
// directory. Throws CheckpointError saying which of the two `path` is not.
std::string resolve_dir(const std::string& path);

// The kinds of the file sets in `dir`: every "<kind>.safetensors.index.json", sorted, model first.
std::vector<std::string> file_set_kinds(const std::string& dir);

// Parses dir/train_state.json as JSON (any JSON object). Throws CheckpointError naming the file.
nlohmann::json read_train_state(const std::string& dir);

// Parses the index of `kind`, reads the header of every file it names and cross-checks the two
// (safetensors::check_index_against_headers). Throws CheckpointError naming file and tensor.
FileSet open_file_set(const std::string& dir, const std::string& kind);

// resolve_dir + read_train_state + open_file_set for every kind found. Throws CheckpointError.
Checkpoint open_checkpoint(const std::string& path);

// Reads `bytes` bytes at `offset` of dir/file into `out` in chunks (bounded memory for callers
// that stream). Throws CheckpointError on a short file or an IO error, naming the file.
void read_bytes(const std::string& dir, const std::string& file, uint64_t offset, uint64_t bytes, std::string& out);
// The same into `out`, which holds at least `bytes`.
void read_bytes_into(const std::string& dir, const std::string& file, uint64_t offset, uint64_t bytes, void* out);

// The model section of the fsdp-train config saved with the checkpoint (train_state.json
// extra.config.model). Throws CheckpointError when it is missing or not a valid LlamaConfig.
llama::LlamaConfig model_config(const Checkpoint& ckpt);

// The tensors LlamaForCausalLM(config) holds, each once (tied ones under their first name), with
// shapes, in registration order. Built on the meta device: allocates nothing.
std::vector<std::pair<std::string, std::vector<int64_t>>> llama_tensors(const llama::LlamaConfig& config);

// Checks that the model file set holds exactly llama_tensors(config) as F32; with tied embeddings
// a stored "lm_head.weight" is allowed too (export leaves it out). Throws CheckpointError naming
// the file and tensor.
void check_llama_tensors(const Checkpoint& ckpt, const llama::LlamaConfig& config);

using fsdp::base::shape_text;

}  // namespace fsdp_ckpt
