// Tracer: spans in memory, written as Chrome trace-event JSON.
#include "fsdp/trace.h"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "fsdp/errors.h"

namespace fsdp {

Tracer::Tracer(int rank) : rank_(rank), origin_(Clock::now()) {}

void Tracer::span(const std::string& name, const std::string& lane, Clock::time_point begin, Clock::time_point end,
                  const std::string& unit) {
  const double ts = std::chrono::duration<double, std::micro>(begin - origin_).count();
  const double dur = std::chrono::duration<double, std::micro>(end - begin).count();
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({name, lane, unit, ts, dur});
}

size_t Tracer::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

void Tracer::write(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  std::map<std::string, int> lanes;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : events_) {
    auto it = lanes.emplace(e.lane, static_cast<int>(lanes.size())).first;
    events.push_back({{"name", e.name},
                      {"cat", "fsdp"},
                      {"ph", "X"},
                      {"ts", e.ts_us},
                      {"dur", e.dur_us},
                      {"pid", rank_},
                      {"tid", it->second},
                      {"args", {{"unit", e.unit}}}});
  }
  for (const auto& [lane, tid] : lanes) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", tid}, {"args", {{"name", lane}}}});
  }
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  std::ofstream out(path);
  if (!out) throw ConfigError("fsdp: cannot write trace file " + path);
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  if (!out) throw ConfigError("fsdp: writing trace file " + path + " failed");
}

Tracer::Scope::Scope(Tracer* tracer, std::string name, std::string lane, std::string unit)
    : tracer_(tracer), name_(std::move(name)), lane_(std::move(lane)), unit_(std::move(unit)), begin_(Clock::now()) {}

Tracer::Scope::~Scope() {
  if (tracer_ != nullptr) tracer_->span(name_, lane_, begin_, Clock::now(), unit_);
}

}  // namespace fsdp
