// Metrics lines, the progress display and communication counters.
#include "metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

namespace train {
namespace {

std::string human_count(double x) {
  return x >= 1e6 ? format("%.2fM", x / 1e6) : x >= 1e3 ? format("%.1fk", x / 1e3) : format("%.0f", x);
}

std::string duration(double s) {
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s / 3600), static_cast<int>(std::fmod(s, 3600) / 60));
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s / 60), static_cast<int>(std::fmod(s, 60)));
  } else {
    std::snprintf(buf, sizeof buf, "%.0fs", s);
  }
  return buf;
}

}  // namespace

std::string format(const char* conversion, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, conversion, x);
  return buf;
}

std::vector<double> RankCounters::values() const {
  return {loss,        allgather_bytes, reduce_scatter_bytes, all_reduce_bytes,  group_allgather_bytes,
          comm_wait_s, peak_rss_bytes,  peak_rss_forward,     peak_rss_backward, peak_rss_optimizer};
}

RankCounters RankCounters::of(const std::vector<double>& v) {
  return {v.at(0), v.at(1), v.at(2), v.at(3), v.at(4), v.at(5), v.at(6), v.at(7), v.at(8), v.at(9)};
}

std::vector<RankCounters> gather_counters(fsdp::Communicator& world, const RankCounters& mine) {
  const int n = world.size();
  const std::vector<double> values = mine.values();
  const int64_t per_rank = static_cast<int64_t>(values.size());
  at::Tensor in = at::tensor(values, at::kDouble);
  at::Tensor out = at::empty({n * per_rank}, at::kDouble);
  world.all_gather(out, in, "train/metrics").wait();
  std::vector<RankCounters> all;
  const double* q = out.data_ptr<double>();
  for (int r = 0; r < n; ++r) all.push_back(RankCounters::of({q + r * per_rank, q + (r + 1) * per_rank}));
  return all;
}

CommCounter::CommCounter(fsdp::DeviceMesh& mesh) {
  made_on_use_ = mesh.groups_made_on_use();
  std::vector<fsdp::Communicator*> all{&mesh.dist().world(), &mesh.shard_group(), &mesh.replicate_group()};
  for (fsdp::Communicator* c : made_on_use_) all.push_back(c);
  for (fsdp::Communicator* c : all) {
    if (std::find(comms_.begin(), comms_.end(), c) == comms_.end()) comms_.push_back(c);
  }
}

fsdp::CommStats CommCounter::snapshot() const { return sum(comms_); }
fsdp::CommStats CommCounter::made_on_use_snapshot() const { return sum(made_on_use_); }

fsdp::CommStats CommCounter::sum(const std::vector<fsdp::Communicator*>& comms) {
  fsdp::CommStats total;
  for (const fsdp::Communicator* c : comms) {
    const auto s = c->stats();
    for (int k = 0; k < fsdp::kNumCollectiveKinds; ++k) {
      total.ops[k].calls += s.ops[k].calls;
      total.ops[k].bytes_sent += s.ops[k].bytes_sent;
      total.ops[k].bytes_received += s.ops[k].bytes_received;
      total.ops[k].busy_s += s.ops[k].busy_s;
      total.ops[k].wait_s += s.ops[k].wait_s;
    }
  }
  return total;
}

// ---- MetricsLog ----------------------------------------------------------------------------------

MetricsLog::MetricsLog(const std::string& path, bool append) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (file_ == nullptr) {
    throw std::invalid_argument("--metrics " + path + ": cannot be opened for writing: " + std::strerror(errno));
  }
}

MetricsLog::~MetricsLog() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsLog::step(const StepMetrics& m) {
  if (file_ == nullptr) return;
  // ordered_json: keys in the documented order, step first, for people reading the file.
  nlohmann::ordered_json j = {{"step", m.step},
                              {"loss", m.loss},
                              {"lr", m.lr},
                              {"step_time_s", m.step_time_s},
                              {"tokens_per_s", m.tokens_per_s}};
  auto column = [&](double RankCounters::*field, bool integral) {
    nlohmann::ordered_json a = nlohmann::ordered_json::array();
    for (const auto& r : m.ranks)
      a.push_back(integral ? nlohmann::ordered_json(static_cast<int64_t>(r.*field)) : nlohmann::ordered_json(r.*field));
    return a;
  };
  j["allgather_bytes"] = column(&RankCounters::allgather_bytes, true);
  j["reduce_scatter_bytes"] = column(&RankCounters::reduce_scatter_bytes, true);
  j["all_reduce_bytes"] = column(&RankCounters::all_reduce_bytes, true);
  const bool grouped =
      std::any_of(m.ranks.begin(), m.ranks.end(), [](const RankCounters& r) { return r.group_allgather_bytes > 0; });
  if (grouped) j["group_allgather_bytes"] = column(&RankCounters::group_allgather_bytes, true);
  j["comm_wait_s"] = column(&RankCounters::comm_wait_s, false);
  j["peak_rss_bytes"] = column(&RankCounters::peak_rss_bytes, true);
  if (!m.ranks.empty() && m.ranks[0].peak_rss_forward > 0) {
    j["phase_peak_rss_bytes"] = {{"forward", column(&RankCounters::peak_rss_forward, true)},
                                 {"backward", column(&RankCounters::peak_rss_backward, true)},
                                 {"optimizer", column(&RankCounters::peak_rss_optimizer, true)}};
  }
  j["skipped"] = m.skipped;
  j["skipped_steps"] = m.skipped_steps;
  j["loss_scale"] = m.loss_scale;
  if (m.grad_norm >= 0) j["grad_norm"] = m.grad_norm;
  if (!m.phases.empty()) {
    nlohmann::ordered_json phases = nlohmann::ordered_json::object();
    for (const auto& [name, s] : m.phases) phases[name] = s;
    j["phase_s"] = phases;
  }
  std::fprintf(file_, "%s\n", j.dump().c_str());
  std::fflush(file_);
}

void MetricsLog::eval(int64_t step, double loss) {
  if (file_ == nullptr) return;
  // Perplexity is exp(mean token loss); past ~709 nats it overflows a double and is written as null.
  const double ppl = std::exp(loss);
  nlohmann::ordered_json j = {{"eval", true}, {"step", step}, {"loss", loss}};
  j["perplexity"] = std::isfinite(ppl) ? nlohmann::ordered_json(ppl) : nlohmann::ordered_json(nullptr);
  std::fprintf(file_, "%s\n", j.dump().c_str());
  std::fflush(file_);
}

// ---- Progress ------------------------------------------------------------------------------------

Progress::Progress(int64_t first_step, int64_t total_steps, int64_t log_every, bool terminal)
    : first_step_(first_step), total_steps_(total_steps), log_every_(log_every), terminal_(terminal) {}

std::string Progress::eta(int64_t step) const {
  const int64_t done = step - first_step_;
  if (done <= 0) return "?";
  return duration(elapsed_s_ / static_cast<double>(done) * static_cast<double>(total_steps_ - step));
}

void Progress::step(const StepMetrics& m) {
  elapsed_s_ += m.step_time_s;
  char line[256];
  if (terminal_) {
    constexpr int kWidth = 24;
    const int filled = total_steps_ > 0 ? static_cast<int>(kWidth * m.step / total_steps_) : kWidth;
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    std::snprintf(line, sizeof line, "\r[%s] %lld/%lld  loss %.4f  %s tok/s  ETA %s   ", bar.c_str(),
                  static_cast<long long>(m.step), static_cast<long long>(total_steps_), m.loss,
                  human_count(m.tokens_per_s).c_str(), eta(m.step).c_str());
    std::fputs(line, stdout);
    std::fflush(stdout);
    bar_drawn_ = true;
    return;
  }
  if (m.step % log_every_ != 0 && m.step != total_steps_ && m.step != first_step_ + 1) return;
  std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  lr %.2e  %s tok/s  %.3f s/step  ETA %s\n",
                static_cast<long long>(m.step), static_cast<long long>(total_steps_), m.loss, m.lr,
                human_count(m.tokens_per_s).c_str(), m.step_time_s, eta(m.step).c_str());
  std::fputs(line, stdout);
  std::fflush(stdout);
}

void Progress::eval(int64_t step, double loss) {
  char line[96];
  std::snprintf(line, sizeof line, "eval step %lld  loss %.4f  perplexity %.2f", static_cast<long long>(step), loss,
                std::exp(loss));
  note(line);
}

void Progress::note(const std::string& line) {
  if (bar_drawn_) std::fputs("\n", stdout);
  bar_drawn_ = false;
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

void Progress::finish() {
  if (bar_drawn_) std::fputs("\n", stdout);
  bar_drawn_ = false;
  std::fflush(stdout);
}

}  // namespace train
