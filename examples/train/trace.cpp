// Trace: span recording and the Chrome trace-event JSON writer.
#include "trace.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace train {

Trace::Trace(const std::string& path, int rank, int world_size)
    : rank_(rank), origin_(std::chrono::steady_clock::now()) {
  if (path.empty() || world_size <= 1) {
    path_ = path;
    return;
  }
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  const std::string tag = ".rank" + std::to_string(rank);
  path_ = has_ext ? path.substr(0, dot) + tag + path.substr(dot) : path + tag;
}

Trace::Span::Span(Trace* trace, const char* name, int64_t step)
    : trace_(trace), name_(name), step_(step), start_(std::chrono::steady_clock::now()) {}

Trace::Span::~Span() {
  if (trace_ == nullptr) return;
  using us = std::chrono::duration<double, std::micro>;
  const auto end = std::chrono::steady_clock::now();
  trace_->events_.push_back({name_, step_, us(start_ - trace_->origin_).count(), us(end - start_).count()});
}

void Trace::write() const {
  if (!enabled()) return;
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  for (const auto& e : events_) {
    events.push_back({{"name", e.name}, {"ph", "X"}, {"pid", rank_}, {"tid", 0}, {"ts", e.start_us},
                      {"dur", e.dur_us}, {"args", {{"step", e.step}}}});
  }
  std::FILE* f = std::fopen(path_.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("--trace " + path_ + ": cannot be written: " + std::strerror(errno));
  const std::string s = nlohmann::json({{"traceEvents", events}, {"displayTimeUnit", "ms"}}).dump();
  const bool ok = std::fwrite(s.data(), 1, s.size(), f) == s.size();
  if (std::fclose(f) != 0 || !ok) throw std::runtime_error("--trace " + path_ + ": write failed");
}

}  // namespace train
