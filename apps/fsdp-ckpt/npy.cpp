// See npy.h. The header is a Python dict literal; we parse the three keys np.save writes:
//   {'descr': '<i8', 'fortran_order': False, 'shape': (2, 16), }
#include "npy.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "base/file_io.h"

namespace fsdp_ckpt {

namespace {

constexpr char kMagic[] = "\x93NUMPY";

[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw std::runtime_error(path + ": not a usable .npy file: " + why);
}

// The text after 'key': up to the next ',' at depth 0 (or the closing brace).
std::string dict_value(const std::string& path, const std::string& header, const std::string& key) {
  const std::string quoted = "'" + key + "'";
  size_t p = header.find(quoted);
  if (p == std::string::npos) fail(path, "header has no " + quoted);
  p = header.find(':', p + quoted.size());
  if (p == std::string::npos) fail(path, "header has no value for " + quoted);
  ++p;
  int depth = 0;
  size_t end = p;
  for (; end < header.size(); ++end) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
  }
  std::string v = header.substr(p, end - p);
  while (!v.empty() && v.front() == ' ') v.erase(v.begin());
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return v;
}

std::vector<int64_t> parse_shape(const std::string& path, const std::string& text) {
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') fail(path, "shape " + text + " is not a tuple");
  std::vector<int64_t> shape;
  std::string inner = text.substr(1, text.size() - 2);
  size_t start = 0;
  while (start < inner.size()) {
    size_t comma = inner.find(',', start);
    if (comma == std::string::npos) comma = inner.size();
    std::string item = inner.substr(start, comma - start);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (!item.empty()) {
      char* end = nullptr;
      const long long n = std::strtoll(item.c_str(), &end, 10);
      if (*end != '\0' || n < 0) fail(path, "shape " + text + " has a bad dimension '" + item + "'");
      shape.push_back(n);
    }
    start = comma + 1;
  }
  return shape;
}

}  // namespace

at::Tensor read_npy_int64(const std::string& path) {
  auto f = fsdp::io::File::open_read(path);
  const uint64_t size = f.size();
  if (size < 10) fail(path, "too short");
  char pre[10];
  f.pread_all(pre, 10, 0);
  if (std::memcmp(pre, kMagic, 6) != 0) fail(path, "no \\x93NUMPY magic");
  if (pre[6] != 1) fail(path, "format version " + std::to_string(static_cast<int>(pre[6])) + " (only 1.x is read)");
  const uint64_t header_len = static_cast<uint8_t>(pre[8]) | (static_cast<uint64_t>(static_cast<uint8_t>(pre[9])) << 8);
  if (10 + header_len > size) fail(path, "header runs past the end of the file");
  std::string header(header_len, '\0');
  f.pread_all(header.data(), header_len, 10);
  const std::string descr = dict_value(path, header, "descr");
  if (descr != "'<i8'") fail(path, "dtype " + descr + "; tokens must be int64 ('<i8', np.int64)");
  if (dict_value(path, header, "fortran_order") != "False") fail(path, "Fortran order; save a C-order array");
  const auto shape = parse_shape(path, dict_value(path, header, "shape"));
  at::Tensor t = at::empty(shape, at::kLong);
  const uint64_t bytes = static_cast<uint64_t>(t.numel()) * sizeof(int64_t);
  if (10 + header_len + bytes != size) {
    fail(path, "shape " + dict_value(path, header, "shape") + " needs " + std::to_string(bytes) +
                   " data bytes, the file has " + std::to_string(size - 10 - header_len));
  }
  f.pread_all(t.data_ptr<int64_t>(), bytes, 10 + header_len);
  return t;
}

void write_npy_float32(const std::string& path, const at::Tensor& tensor) {
  const at::Tensor t = tensor.to(at::kFloat).contiguous();
  std::string shape = "(";
  for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
  shape += t.dim() == 1 ? ",)" : ")";  // a 1-tuple is written (3,)
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  // Padded with spaces and ended by '\n' so the data starts at a multiple of 64.
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string prefix(kMagic, 6);
  prefix += '\x01';
  prefix += '\x00';
  prefix += static_cast<char>(header.size() & 0xff);
  prefix += static_cast<char>((header.size() >> 8) & 0xff);
  auto f = fsdp::io::File::open_write(path, /*create_truncate=*/true);
  f.pwrite_all(prefix.data(), prefix.size(), 0);
  f.pwrite_all(header.data(), header.size(), prefix.size());
  f.pwrite_all(t.data_ptr<float>(), t.numel() * sizeof(float), prefix.size() + header.size());
  f.close();
}

}  // namespace fsdp_ckpt
