// Per-rank traces in Chrome's trace-event format (open in Perfetto or chrome://tracing): compute
// spans (fsdp::forward, fsdp::backward, fsdp::optimizer_step), communication spans from issue to
// completion (fsdp::all_gather, fsdp::reduce_scatter, ...) and the time the training thread was
// blocked waiting for them (fsdp::all_gather_wait, fsdp::reduce_scatter_wait), with the unit in
// the span's args.
//
//   auto tracer = std::make_shared<fsdp::Tracer>(dist->rank());
//   root->set_tracer(tracer);            // units, their communicators and the optimizer step
//   ... train ...
//   tracer->write("trace-rank0.json");
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp {

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Tracer(int rank);

  // A complete span on a named lane (one Perfetto track per lane).
  void span(const std::string& name, const std::string& lane, Clock::time_point begin, Clock::time_point end,
            const std::string& unit);
  void write(const std::string& path) const;
  size_t size() const;

  // Records [construction, destruction) as one span.
  class Scope {
   public:
    Scope(Tracer* tracer, std::string name, std::string lane, std::string unit);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Tracer* tracer_;
    std::string name_, lane_, unit_;
    Clock::time_point begin_;
  };

 private:
  struct Event {
    std::string name, lane, unit;
    double ts_us, dur_us;
  };
  int rank_;
  Clock::time_point origin_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

}  // namespace fsdp
