// Safetensors headers: planning the layout of files we write, and parsing and validating the
// headers of files we read (Note [Safetensors validation] in safetensors.h).
//
// The header is parsed with a SAX handler that knows the expected shape of the document and stops
// at the first thing out of place. No JSON DOM is built, so memory stays proportional to what a
// valid header would hold however the text is crafted, and duplicate keys, which a DOM silently
// collapses, are seen.
#include "base/file_io.h"
#include "base/named.h"
#include "base/strings.h"
#include "safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "fsdp/errors.h"

namespace fsdp {
namespace safetensors {
namespace {

using Json = nlohmann::json;

// The dtype table (base/named.h): value, the format's spelling, bytes per element.
struct DTypeInfo {
  DType value;
  const char* name;
  size_t itemsize;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},           {DType::I8, "I8", 1},           {DType::I16, "I16", 2},
    {DType::U16, "U16", 2},   {DType::F16, "F16", 2},         {DType::BF16, "BF16", 2},       {DType::I32, "I32", 4},
    {DType::U32, "U32", 4},   {DType::F32, "F32", 4},         {DType::F64, "F64", 8},         {DType::I64, "I64", 8},
    {DType::U64, "U64", 8},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};

const DTypeInfo& info(DType dtype) {
  if (const DTypeInfo* d = base::row_of(kDTypes, dtype)) return *d;
  throw CheckpointError("fsdp: invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

[[noreturn]] void fail(const std::string& label, const std::string& what) {
  throw CheckpointError("fsdp: checkpoint file " + label + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& label, const std::string& name, const std::string& what) {
  fail(label, "tensor " + quote_name(name) + ": " + what);
}

std::string span_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

using base::shape_text;

// numel x itemsize, or false when it does not fit in uint64 (the reference checks every partial
// product, so a zero dimension after an overflowing prefix still fails).
bool byte_count(const std::vector<int64_t>& shape, DType dtype, uint64_t* nbytes) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  return !__builtin_mul_overflow(n, static_cast<uint64_t>(itemsize(dtype)), nbytes);
}

bool entry_order(const TensorEntry& a, const TensorEntry& b) {
  if (a.begin != b.begin) return a.begin < b.begin;
  if (a.end != b.end) return a.end < b.end;
  return a.name < b.name;
}

// Walks the header document. Each event either fits the state or throws CheckpointError naming
// the file and, inside an entry, the tensor.
class HeaderSax : public nlohmann::json_sax<Json> {
 public:
  explicit HeaderSax(const std::string& label) : label_(label) {}

  std::vector<TensorEntry> take_entries() { return std::move(entries_); }
  std::map<std::string, std::string> take_metadata() { return std::move(metadata_); }

  bool null() override { return unexpected("null"); }
  bool boolean(bool) override { return unexpected("a boolean"); }
  bool binary(binary_t&) override { return unexpected("binary data"); }

  bool number_integer(number_integer_t value) override {
    // nlohmann reports only negative integers (and -0) here.
    if (state_ == State::kShape) {
      fail_tensor(label_, entry_.name, "shape dimension " + negative_text(value) + " is negative");
    }
    if (state_ == State::kOffsets) {
      fail_tensor(label_, entry_.name, "data_offsets value " + negative_text(value) + " is negative");
    }
    return unexpected("a negative integer");
  }

  bool number_unsigned(number_unsigned_t value) override {
    if (state_ == State::kShape) {
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail_tensor(label_, entry_.name, "shape dimension " + std::to_string(value) + " does not fit in int64");
      }
      entry_.shape.push_back(static_cast<int64_t>(value));
      return true;
    }
    if (state_ == State::kOffsets) {
      if (offsets_.size() == 2) {
        fail_tensor(label_, entry_.name, "data_offsets has more than 2 values");
      }
      offsets_.push_back(value);
      return true;
    }
    return unexpected("a number");
  }

  bool number_float(number_float_t, const string_t& text) override {
    if (state_ == State::kShape || state_ == State::kOffsets) {
      const char* what = state_ == State::kShape ? "shape dimension " : "data_offsets value ";
      fail_tensor(label_, entry_.name, what + text + " is not a non-negative integer");
    }
    return unexpected("a number");
  }

  bool string(string_t& value) override {
    if (state_ == State::kEntryValue && field_ == Field::kDType) {
      try {
        entry_.dtype = parse_dtype(value);
      } catch (const CheckpointError&) {
        fail_tensor(label_, entry_.name, "unknown dtype " + quote_name(value));
      }
      state_ = State::kEntry;
      return true;
    }
    if (state_ == State::kMetadataValue) {
      metadata_[metadata_key_] = value;
      state_ = State::kMetadata;
      return true;
    }
    return unexpected("a string");
  }

  bool start_object(std::size_t) override {
    switch (state_) {
      case State::kStart: state_ = State::kRoot; return true;
      case State::kEntryStart: state_ = State::kEntry; return true;
      case State::kMetadataStart: state_ = State::kMetadata; return true;
      default: return unexpected("an object");
    }
  }

  bool key(string_t& key) override {
    if (state_ == State::kRoot) {
      if (!root_keys_.insert(key).second) {
        if (key == "__metadata__") fail(label_, "__metadata__ appears twice in the header");
        fail_tensor(label_, key, "the name appears twice in the header");
      }
      if (key == "__metadata__") {
        state_ = State::kMetadataStart;
      } else {
        entry_ = TensorEntry{};
        entry_.name = key;
        offsets_.clear();
        seen_fields_ = 0;
        state_ = State::kEntryStart;
      }
      return true;
    }
    if (state_ == State::kEntry) {
      if (key == "dtype") field_ = Field::kDType;
      else if (key == "shape") field_ = Field::kShape;
      else if (key == "data_offsets") field_ = Field::kOffsets;
      else fail_tensor(label_, entry_.name, "unexpected field " + quote_name(key));
      const unsigned bit = 1u << static_cast<unsigned>(field_);
      if (seen_fields_ & bit) {
        fail_tensor(label_, entry_.name, "field " + quote_name(key) + " appears twice");
      }
      seen_fields_ |= bit;
      state_ = State::kEntryValue;
      return true;
    }
    if (state_ == State::kMetadata) {
      if (metadata_.count(key)) {
        fail(label_, "__metadata__ key " + quote_name(key) + " appears twice");
      }
      metadata_key_ = key;
      state_ = State::kMetadataValue;
      return true;
    }
    return unexpected("a key");  // not reached: keys come only inside objects
  }

  bool end_object() override {
    switch (state_) {
      case State::kRoot: state_ = State::kDone; return true;
      case State::kMetadata: state_ = State::kRoot; return true;
      case State::kEntry:
        for (const Field f : {Field::kDType, Field::kShape, Field::kOffsets}) {
          if (!(seen_fields_ & (1u << static_cast<unsigned>(f)))) {
            fail_tensor(label_, entry_.name, std::string("field '") + field_name(f) + "' is missing");
          }
        }
        entry_.begin = offsets_[0];
        entry_.end = offsets_[1];
        entries_.push_back(std::move(entry_));
        state_ = State::kRoot;
        return true;
      default: return unexpected("the end of an object");
    }
  }

  bool start_array(std::size_t) override {
    if (state_ == State::kEntryValue && field_ == Field::kShape) {
      state_ = State::kShape;
      return true;
    }
    if (state_ == State::kEntryValue && field_ == Field::kOffsets) {
      state_ = State::kOffsets;
      return true;
    }
    return unexpected("an array");
  }

  bool end_array() override {
    if (state_ == State::kShape) {
      state_ = State::kEntry;
      return true;
    }
    if (state_ == State::kOffsets) {
      if (offsets_.size() != 2) {
        fail_tensor(label_, entry_.name, "data_offsets has " + std::to_string(offsets_.size()) + " values, not 2");
      }
      state_ = State::kEntry;
      return true;
    }
    return unexpected("the end of an array");  // not reached: arrays open only in those states
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    const std::string where = in_entry() ? "tensor " + quote_name(entry_.name) + ": " : "";
    fail(label_, where + "header is not valid JSON: " + e.what());
  }

 private:
  enum class State {
    kStart,
    kRoot,
    kEntryStart,
    kEntry,
    kEntryValue,
    kShape,
    kOffsets,
    kMetadataStart,
    kMetadata,
    kMetadataValue,
    kDone,
  };
  enum class Field : unsigned { kDType, kShape, kOffsets };

  // nlohmann reports "-0" as the integer 0.
  static std::string negative_text(number_integer_t value) { return value == 0 ? "-0" : std::to_string(value); }

  static const char* field_name(Field f) {
    switch (f) {
      case Field::kDType: return "dtype";
      case Field::kShape: return "shape";
      default: return "data_offsets";
    }
  }

  bool in_entry() const {
    return state_ == State::kEntryStart || state_ == State::kEntry || state_ == State::kEntryValue ||
           state_ == State::kShape || state_ == State::kOffsets;
  }

  // A value of kind `what` where the state allows none of that kind.
  [[noreturn]] bool unexpected(const std::string& what) {
    switch (state_) {
      case State::kStart: fail(label_, "header is not a JSON object (it holds " + what + ")");
      case State::kEntryStart: fail_tensor(label_, entry_.name, "entry is " + what + ", not an object");
      case State::kEntryValue:
        fail_tensor(label_, entry_.name,
                    std::string("field '") + field_name(field_) + "' is " + what + ", not " +
                        (field_ == Field::kDType ? "a string" : "an array of integers"));
      case State::kShape: fail_tensor(label_, entry_.name, "shape holds " + what + ", not only integers");
      case State::kOffsets: fail_tensor(label_, entry_.name, "data_offsets holds " + what + ", not only integers");
      case State::kMetadataStart: fail(label_, "__metadata__ is " + what + ", not an object of strings");
      case State::kMetadataValue:
        fail(label_, "__metadata__ value of key " + quote_name(metadata_key_) + " is " + what + ", not a string");
      default: fail(label_, "header holds " + what + " where none is allowed");
    }
  }

  const std::string& label_;
  State state_ = State::kStart;
  Field field_ = Field::kDType;
  unsigned seen_fields_ = 0;
  TensorEntry entry_;
  std::vector<uint64_t> offsets_;
  std::set<std::string> root_keys_;
  std::vector<TensorEntry> entries_;
  std::string metadata_key_;
  std::map<std::string, std::string> metadata_;
};

// Per-entry checks, then coverage of the data buffer in offset order.
void validate_entries(const std::string& label, std::vector<TensorEntry>* entries, uint64_t data_len,
                      uint64_t file_size) {
  for (const TensorEntry& e : *entries) {
    if (e.begin > e.end) {
      fail_tensor(
          label, e.name,
          "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "] end before they begin");
    }
    if (e.end > data_len) {
      fail_tensor(label, e.name,
                  "data span " + span_text(e.begin, e.end) + " runs past the end of the data buffer, which is " +
                      std::to_string(data_len) + " bytes (file is " + std::to_string(file_size) + " bytes)");
    }
    uint64_t needed = 0;
    if (!byte_count(e.shape, e.dtype, &needed)) {
      fail_tensor(label, e.name,
                  "shape " + shape_text(e.shape) + " x " + dtype_name(e.dtype) + " overflows a 64-bit byte count");
    }
    if (needed != e.nbytes()) {
      fail_tensor(label, e.name,
                  "data span " + span_text(e.begin, e.end) + " is " + std::to_string(e.nbytes()) + " bytes but shape " +
                      shape_text(e.shape) + " x " + dtype_name(e.dtype) + " needs " + std::to_string(needed));
    }
  }
  std::sort(entries->begin(), entries->end(), entry_order);
  uint64_t covered = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry& e : *entries) {
    if (e.begin < covered) {
      fail_tensor(label, e.name,
                  "data span " + span_text(e.begin, e.end) + " overlaps tensor " + quote_name(prev->name) + " at " +
                      span_text(prev->begin, prev->end));
    }
    if (e.begin > covered) {
      fail_tensor(label, e.name,
                  "bytes " + span_text(covered, e.begin) +
                      " before its data belong to no tensor (gap in the data "
                      "buffer)");
    }
    covered = e.end;
    prev = &e;
  }
  if (covered != data_len) {
    const std::string extra = std::to_string(data_len - covered) + " bytes";
    if (prev == nullptr) fail(label, "header lists no tensors but the data buffer holds " + extra);
    fail_tensor(label, prev->name,
                "file has " + extra + " of trailing data after this, the " + "last tensor (data ends at " +
                    std::to_string(covered) + ", buffer is " + std::to_string(data_len) + " bytes)");
  }
}

// Closes a file descriptor on every path out of read_header.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

void pread_exact(const std::string& path, int fd, char* out, uint64_t len, uint64_t offset) {
  const io::Transfer t = io::pread_full(fd, out, len, offset);
  const std::string at = std::to_string(offset + t.bytes);
  if (t.error != 0) fail(path, "read failed at offset " + at + ": " + std::strerror(t.error));
  if (t.bytes < len) fail(path, "unexpected end of file at offset " + at);
}

}  // namespace

std::string quote_name(const std::string& name) {
  constexpr size_t kMaxShown = 200;
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += "'";
  if (name.size() > kMaxShown) out += "... (" + std::to_string(name.size()) + " bytes)";
  return out;
}

size_t first_invalid_utf8(const std::string& text) {
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Lead byte -> sequence length and the allowed range of the second byte (Unicode 15, table
    // 3-7); the third and fourth bytes are always 80..BF.
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) len = 3, lo = 0xa0;
    else if (c >= 0xe1 && c <= 0xec) len = 3;
    else if (c == 0xed) len = 3, hi = 0x9f;  // excludes the UTF-16 surrogates
    else if (c >= 0xee && c <= 0xef) len = 3;
    else if (c == 0xf0) len = 4, lo = 0x90;
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else if (c == 0xf4) len = 4, hi = 0x8f;  // nothing above U+10FFFF
    else return i;
    if (n - i < len) return i;
    const unsigned char c1 = static_cast<unsigned char>(text[i + 1]);
    if (c1 < lo || c1 > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      const unsigned char ck = static_cast<unsigned char>(text[i + k]);
      if (ck < 0x80 || ck > 0xbf) return i;
    }
    i += len;
  }
  return std::string::npos;
}

size_t itemsize(DType dtype) { return info(dtype).itemsize; }

const char* dtype_name(DType dtype) { return info(dtype).name; }

DType parse_dtype(const std::string& name) {
  if (auto dtype = base::value_of(kDTypes, name)) return *dtype;
  throw CheckpointError("fsdp: unknown safetensors dtype " + quote_name(name));
}

const TensorEntry* Header::find(const std::string& name) const {
  for (const TensorEntry& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

FilePlan plan_file(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata) {
  const std::string label = "(being planned)";
  FilePlan plan;
  Json root = Json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    if (t.name == "__metadata__") fail_tensor(label, t.name, "the name is reserved");
    if (first_invalid_utf8(t.name) != std::string::npos) {
      fail_tensor(label, t.name, "the name is not valid UTF-8");
    }
    if (!names.insert(t.name).second) fail_tensor(label, t.name, "the name appears twice");
    for (int64_t d : t.shape) {
      if (d < 0) fail_tensor(label, t.name, "shape " + shape_text(t.shape) + " is negative");
    }
    uint64_t nbytes = 0;
    if (!byte_count(t.shape, t.dtype, &nbytes)) {
      fail_tensor(label, t.name,
                  "shape " + shape_text(t.shape) + " x " + dtype_name(t.dtype) + " overflows a 64-bit byte count");
    }
    TensorEntry e{t.name, t.dtype, t.shape, offset, 0};
    if (__builtin_add_overflow(offset, nbytes, &e.end)) {
      fail_tensor(label, t.name, "the file's data would exceed 2^64 bytes");
    }
    offset = e.end;
    root[t.name] = Json{{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {e.begin, e.end}}};
    plan.header.tensors.push_back(std::move(e));
  }
  if (!metadata.empty()) {
    for (const auto& kv : metadata) {
      if (first_invalid_utf8(kv.first) != std::string::npos || first_invalid_utf8(kv.second) != std::string::npos) {
        fail(label, "__metadata__ key " + quote_name(kv.first) + " or its value is not UTF-8");
      }
    }
    root["__metadata__"] = metadata;
  }
  std::string text = root.dump();
  // Pad with spaces (still valid JSON) so the data buffer starts aligned, as the reference does.
  text.append((kDataAlignment - (8 + text.size()) % kDataAlignment) % kDataAlignment, ' ');
  if (text.size() > kMaxHeaderLen) {
    fail(label, "header would be " + std::to_string(text.size()) + " bytes, over the safetensors limit of " +
                    std::to_string(kMaxHeaderLen) + "; split the tensors over more files");
  }
  const uint64_t n = text.size();
  plan.header_bytes.resize(8);
  for (int i = 0; i < 8; ++i) plan.header_bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  plan.header_bytes += text;
  plan.header.header_len = n;
  plan.header.metadata = metadata;
  std::sort(plan.header.tensors.begin(), plan.header.tensors.end(), entry_order);
  if (__builtin_add_overflow(plan.header.data_start(), offset, &plan.file_size)) {
    fail(label, "the file would exceed 2^64 bytes");
  }
  return plan;
}

Header parse_header(const std::string& file_label, const std::string& header_json, uint64_t header_len,
                    uint64_t file_size) {
  if (file_size < 8) {
    fail(file_label, "file is " + std::to_string(file_size) + " bytes, too short for the 8-byte header length");
  }
  if (header_len > kMaxHeaderLen) {
    fail(file_label, "header length " + std::to_string(header_len) + " is over the safetensors limit of " +
                         std::to_string(kMaxHeaderLen) + " bytes");
  }
  if (header_len > file_size - 8) {
    fail(file_label, "header length " + std::to_string(header_len) + " runs past the end of the file, which is " +
                         std::to_string(file_size) + " bytes");
  }
  if (header_json.size() != header_len) {
    fail(file_label, "header text is " + std::to_string(header_json.size()) + " bytes but the length prefix says " +
                         std::to_string(header_len));
  }
  if (header_json.empty() || header_json[0] != '{') {
    fail(file_label, "header does not start with '{', so it is not a JSON object");
  }
  const size_t bad = first_invalid_utf8(header_json);
  if (bad != std::string::npos) {
    fail(file_label, "header is not valid UTF-8 (bad byte at header offset " + std::to_string(bad) + ")");
  }
  // Valid JSON has no raw NUL (only the escape \u0000), and nlohmann's lexer would take one for
  // the end of input and ignore whatever follows.
  const size_t nul = header_json.find('\0');
  if (nul != std::string::npos) {
    fail(file_label, "header has a NUL byte at header offset " + std::to_string(nul));
  }
  HeaderSax sax(file_label);
  Json::sax_parse(header_json, &sax, Json::input_format_t::json, /*strict=*/true);
  Header header;
  header.header_len = header_len;
  header.tensors = sax.take_entries();
  header.metadata = sax.take_metadata();
  validate_entries(file_label, &header.tensors, file_size - header.data_start(), file_size);
  return header;
}

Header read_header(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    fail(path, "file is " + std::to_string(file_size) + " bytes, too short for the 8-byte header length");
  }
  unsigned char prefix[8];
  pread_exact(path, fd.get(), reinterpret_cast<char*>(prefix), 8, 0);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | prefix[i];
  // Checked before allocating: the length is untrusted.
  if (header_len > kMaxHeaderLen || header_len > file_size - 8) {
    return parse_header(path, std::string(), header_len, file_size);  // throws the right message
  }
  std::string text(header_len, '\0');
  pread_exact(path, fd.get(), text.data(), header_len, 8);
  return parse_header(path, text, header_len, file_size);
}

}  // namespace safetensors
}  // namespace fsdp
