// Small text helpers for error messages and reports, shared by every layer.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace fsdp::base {

// Up to the first newline (messages that carry a backtrace or a second line of detail).
std::string first_line(const std::string& text);
std::string first_line(const std::exception& e);
// "12.50 MiB" with `digits` decimals.
std::string mib(int64_t bytes, int digits = 2);
// Whether `s` ends with `suffix`.
bool ends_with(const std::string& s, const std::string& suffix);
// "[2, 3, 4]".
std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace fsdp::base
