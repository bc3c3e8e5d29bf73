// The safetensors file format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length N, N bytes of UTF-8 JSON mapping tensor names to {dtype, shape, data_offsets} plus
// an optional "__metadata__" object of strings, then the data buffer. This file plans the layout of
// files we write and parses and validates the headers of files we read; moving tensor bytes is the
// caller's business (every rank writes and reads its own byte ranges, see src/checkpoint/).
//
// Nothing here depends on LibTorch, so the fuzz build (fuzz/) compiles it alone; the conversions
// to and from at::ScalarType live in torch_dtypes.h.
//
// Note [Safetensors validation]
// A file is accepted only if the reference implementation would accept it, and a few things more
// are refused (so we are at least as strict): the header starts with '{'; every entry has exactly
// the fields dtype, shape and data_offsets; no name appears twice (JSON parsers differ on which
// duplicate wins, so a duplicate is refused rather than resolved); shape dimensions fit int64.
// Entries sorted by offsets must cover the data buffer from 0 to its end without gap or overlap,
// and each entry's byte span must equal shape product x itemsize, computed without overflow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp {
namespace safetensors {

// The reference implementation's limit on N; a larger header is refused before it is read.
constexpr uint64_t kMaxHeaderLen = 100000000;
// Our headers are padded with spaces so that the data buffer starts at a multiple of this.
constexpr uint64_t kDataAlignment = 8;

// The element types a safetensors file can name and we can map to an at::ScalarType. The
// enumerators are spelled as in the file ("F32", "BF16") rather than kConstant, so that code and
// headers read alike.
enum class DType {
  BOOL,
  U8,
  I8,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
  F8_E4M3,
  F8_E5M2,
};

// Bytes per element.
size_t itemsize(DType dtype);
// "F32" -> DType::F32. Throws CheckpointError naming the string for anything else.
DType parse_dtype(const std::string& name);
// DType::F32 -> "F32", the spelling the format uses.
const char* dtype_name(DType dtype);

// A tensor to be written: what plan_file needs to know, nothing about its values.
struct TensorSpec {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
};

// A tensor as a header describes it. begin and end are byte offsets relative to the start of the
// data buffer (Header::data_start()), as in the file.
struct TensorEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
};

// A validated header.
struct Header {
  std::vector<TensorEntry> tensors;  // sorted by (begin, end, name)
  std::map<std::string, std::string> metadata;
  uint64_t header_len = 0;  // N, the length of the JSON text including padding

  uint64_t data_start() const { return 8 + header_len; }
  // The entry named `name`, or nullptr. A linear scan: callers looking up many names build a map.
  const TensorEntry* find(const std::string& name) const;
};

// The complete layout of a file to be written.
struct FilePlan {
  std::string header_bytes;  // the 8-byte length and the JSON, padded so data starts aligned
  Header header;
  uint64_t file_size = 0;
};

// Lays `tensors` out contiguously in the given order. Computed from names, dtypes and shapes alone,
// so every rank of a job computes the same plan and writes its own byte ranges at known offsets;
// the same input always yields the same bytes. Tensors that must be aligned for zero-copy readers
// should come in order of decreasing itemsize (what the reference writer does). Throws
// CheckpointError on a duplicate or reserved name, a negative dimension, or a size that overflows.
FilePlan plan_file(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata);

// Parses and validates a header (see Note [Safetensors validation]). `header_json` is the N bytes
// after the length prefix, `header_len` is N and `file_size` the size of the whole file;
// `file_label` names the file in error messages. Throws CheckpointError.
Header parse_header(const std::string& file_label, const std::string& header_json, uint64_t header_len,
                    uint64_t file_size);

// Reads the first 8 + N bytes of the file at `path` (never the data) and parses them with
// parse_header. Throws CheckpointError, also when the file cannot be opened or read.
Header read_header(const std::string& path);

// ---- text helpers shared with index.cpp

// `name` in single quotes for an error message, with control characters escaped and anything
// past 200 bytes cut, so a hostile name cannot flood a log or a terminal.
std::string quote_name(const std::string& name);
// The offset of the first byte that is not part of well-formed UTF-8 (no overlong forms, no
// surrogates, nothing above U+10FFFF), or std::string::npos when all of `text` is well formed.
size_t first_invalid_utf8(const std::string& text);

}  // namespace safetensors
}  // namespace fsdp
