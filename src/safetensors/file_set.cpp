// See file_set.h.
#include "safetensors/file_set.h"

#include "base/file_io.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace safetensors {

std::optional<FileSet> read_file_set(const std::string& dir, const std::string& index_name, const std::string& label) {
  const std::string index_path = io::join(dir, index_name);
  if (!io::exists(index_path)) return std::nullopt;
  FileSet set;
  set.index = parse_index(index_path, io::read_small_file(index_path));
  for (const auto& file : set.index.files()) {
    const std::string path = io::join(dir, file);
    if (!io::exists(path)) throw CheckpointError(label + " lists " + file + ", which does not exist");
    set.headers[file] = read_header(path);
  }
  check_index_against_headers(dir, set.index, set.headers);
  return set;
}

FileSet read_single_file(const std::string& dir, const std::string& file) {
  FileSet set;
  const Header& header = set.headers[file] = read_header(io::join(dir, file));
  for (const auto& e : header.tensors) set.index.weight_map[e.name] = file;
  return set;
}

std::optional<FileSet> read_index_or_file(const std::string& dir, const std::string& file, const std::string& label) {
  if (std::optional<FileSet> set = read_file_set(dir, file + ".index.json", label)) return set;
  if (io::exists(io::join(dir, file))) return read_single_file(dir, file);
  return std::nullopt;
}

}  // namespace safetensors
}  // namespace fsdp
