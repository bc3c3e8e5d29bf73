// A Chrome trace (Perfetto, chrome://tracing) of the trainer's step phases: one complete event per
// span, named "train::<phase>" with the step as an argument, pid = rank. Events are kept in memory
// and written once by write(); a disabled trace (empty path) costs one branch per span.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace train {

class Trace {
 public:
  // `path` "" disables tracing. With world_size > 1 each rank writes its own file: ".rankK" goes
  // before the extension (trace.json -> trace.rank1.json), so ranks never share a file.
  Trace(const std::string& path, int rank, int world_size);

  // Records [construction, destruction) as one event.
  class Span {
   public:
    Span(Trace* trace, const char* name, int64_t step);
    ~Span();
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    Trace* trace_;
    const char* name_;
    int64_t step_;
    std::chrono::steady_clock::time_point start_;
  };

  Span span(const char* name, int64_t step) { return Span(enabled() ? this : nullptr, name, step); }
  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  // Writes the file (overwriting it); throws std::runtime_error naming the file on failure.
  void write() const;

 private:
  struct Event {
    const char* name;
    int64_t step;
    double start_us, dur_us;
  };
  std::string path_;
  int rank_;
  std::chrono::steady_clock::time_point origin_;
  std::vector<Event> events_;
};

}  // namespace train
