// See strings.h.
#include "base/strings.h"

#include <cstdio>

namespace fsdp::base {

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

std::string first_line(const std::exception& e) { return first_line(std::string(e.what())); }

std::string mib(int64_t bytes, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f MiB", digits, static_cast<double>(bytes) / (1 << 20));
  return buf;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace fsdp::base
