// The compute floor for `scripts/bench compare`: fsdp-train's model, data, loss, clipping and LR
// schedule trained on one process with plain LibTorch (no sharding, no communication), writing the
// same --metrics lines as fsdp-train. It also dumps the training batches for the Python FSDP2 run,
// so all three systems see the very same tokens.
//
//   bench_unsharded [fsdp-train flags: --set K=V, --steps N, --seed, --config] --metrics run.jsonl
//   bench_unsharded [same] --dump-data batches.bin --world 2
//   bench_unsharded [same] --init-only --metrics base.jsonl   # memory baseline: no model built
//
// On `--set fsdp.device=cuda` it trains on the current CUDA device (the GPU check's floor); with
// `fsdp.param_dtype` bfloat16 or float16 the model computes in that dtype from an fp32 master per
// parameter (the master stepped, then copied into the model): the same mixed precision as
// fsdp-train's, without sharding. Each --metrics line then has `peak_device_allocated_bytes` and
// `peak_device_reserved_bytes` (the caching allocator's high-water marks since the start).
//
// The optimizer step and clipping use fsdp's own element-wise kernels (kernels/ops.h) on each
// unsharded parameter, in fsdp's two groups (weight decay on >= 2-D parameters only): the same
// arithmetic fsdp's sharded AdamW and clip_grad_norm do, so "fsdp on 1 rank / this" is the cost of
// sharding alone, not that cost mixed with the gain of a fused optimizer over torch::optim::AdamW.
// (fsdp's own AdamW would need a fully_shard'ed model even on one rank: flat buffers, unit hooks
// and copies, the very costs this floor leaves out.)
//
// --dump-data writes int64 little-endian [steps, world, 2 (inputs, targets), batch_per_rank,
// seq_len]: rank r of step s trains on element [s, r], as fsdp-train's rank_batch gives it.
#include <ATen/Parallel.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.h"
#include "data.h"
#include "flags.h"
#include "fsdp/init.h"
#include "fsdp/optim.h"
#include "fsdp/options.h"
#include "kernels/ops.h"
#include "llama.h"
#include "metrics.h"
#include "sysinfo/sysinfo.h"

namespace {

struct Extra {
  std::string dump_path;   // --dump-data FILE
  int world = 1;           // --world N (with --dump-data)
  bool init_only = false;  // --init-only: report the peak RSS before any model is built, then exit
};

// Takes this tool's own flags out of argv; the rest are fsdp-train's.
Extra take_extra_flags(std::vector<const char*>& args) {
  Extra extra;
  std::vector<const char*> rest{args[0]};
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument("flag " + a + " needs a value");
      return args[++i];
    };
    if (a == "--dump-data") {
      extra.dump_path = value();
    } else if (a == "--init-only") {
      extra.init_only = true;
    } else if (a == "--world") {
      extra.world = std::stoi(value());
      if (extra.world < 1) throw std::invalid_argument("--world must be >= 1");
    } else {
      rest.push_back(args[i]);
    }
  }
  args = rest;
  return extra;
}

void dump_batches(const train::TrainConfig& cfg, const train::Dataset& data, const Extra& extra) {
  std::FILE* f = std::fopen(extra.dump_path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + extra.dump_path);
  const int64_t per_rank = cfg.data.batch_size_per_rank;
  const int64_t global = per_rank * extra.world;
  for (int64_t step = 0; step < cfg.train.steps; ++step) {
    for (int r = 0; r < extra.world; ++r) {
      const auto b = train::rank_batch(data, step * global, per_rank, r, train::Split::kTrain);
      for (const auto& t : {b.inputs.contiguous(), b.targets.contiguous()}) {
        const size_t n = static_cast<size_t>(t.numel());
        if (std::fwrite(t.data_ptr<int64_t>(), sizeof(int64_t), n, f) != n) {
          std::fclose(f);
          throw std::runtime_error("short write to " + extra.dump_path);
        }
      }
    }
  }
  if (std::fclose(f) != 0) throw std::runtime_error("cannot close " + extra.dump_path);
}

double lr_at(const train::OptimConfig& o, int64_t step, int64_t total_steps) {
  if (o.schedule == train::Schedule::kConstant) {
    if (step < o.warmup_steps) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
    return o.lr;
  }
  return fsdp::WarmupCosine(o.lr, o.warmup_steps, total_steps, o.min_lr).lr_at(step);
}

// One unsharded parameter and its AdamW state, stepped by fsdp's fused kernel. `master` is the
// fp32 value the optimizer steps: the parameter itself in fp32 compute, else a copy of its own.
struct ParamState {
  at::Tensor param, master, exp_avg, exp_avg_sq;
  double weight_decay = 0;
  int64_t step = 0;
};

// Each parameter's gradient in fp32, as fsdp's reduced gradient shards are (undefined where none).
std::vector<at::Tensor> fp32_grads(const std::vector<ParamState>& states) {
  std::vector<at::Tensor> grads;
  for (const auto& s : states) {
    const at::Tensor& g = s.param.grad();
    grads.push_back(!g.defined() || g.scalar_type() == at::kFloat ? g : g.to(at::kFloat));
  }
  return grads;
}

// fsdp::clip_grad_norm's arithmetic on unsharded gradients: the sum of squares in double, one
// scale when the norm exceeds max_norm.
void clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm, const c10::Device& device) {
  auto sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& g : grads) {
    if (g.defined()) fsdp::kernels::sum_of_squares(g, sq);
  }
  const double coef = max_norm / (std::sqrt(sq.item<double>()) + 1e-6);
  if (coef >= 1) return;
  for (const auto& g : grads) {
    if (g.defined()) fsdp::kernels::scale_(g, coef);
  }
}

void adamw_step(std::vector<ParamState>& states, const std::vector<at::Tensor>& grads, const train::OptimConfig& o,
                double lr) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < states.size(); ++i) {
    ParamState& s = states[i];
    if (!grads[i].defined()) continue;
    fsdp::kernels::AdamWArgs args;
    args.lr = lr;
    args.beta1 = o.betas[0];
    args.beta2 = o.betas[1];
    args.eps = o.eps;
    args.weight_decay = s.weight_decay;
    args.step = ++s.step;
    fsdp::kernels::fused_adamw(args, s.master, grads[i], s.exp_avg, s.exp_avg_sq);
    if (!s.master.is_same(s.param)) s.param.copy_(s.master);
  }
}

// The caching allocator's peak allocated and reserved bytes on `device` (0, 0 on the CPU).
std::pair<double, double> device_peaks(const c10::Device& device) {
  if (device.is_cpu()) return {0, 0};
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {static_cast<double>(stats.allocated_bytes[all].peak), static_cast<double>(stats.reserved_bytes[all].peak)};
}

void write_line(std::FILE* metrics, const nlohmann::json& line) {
  std::fprintf(metrics, "%s\n", line.dump().c_str());
  std::fflush(metrics);
}

void train_unsharded(const train::TrainConfig& cfg, const train::Flags& flags, const train::Dataset& data,
                     bool init_only) {
  using Clock = std::chrono::steady_clock;
  std::FILE* metrics = flags.metrics.empty() ? nullptr : std::fopen(flags.metrics.c_str(), "w");
  if (!flags.metrics.empty() && metrics == nullptr) throw std::runtime_error("cannot write " + flags.metrics);
  if (init_only) {
    // The process's own baseline: libraries loaded, config and data ready, no model yet.
    if (metrics != nullptr) {
      write_line(metrics, {{"init_only", true},
                           {"peak_rss_bytes", {static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes())}}});
      std::fclose(metrics);
    }
    std::printf("bench_unsharded: init only, peak RSS %.1f MiB\n",
                static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes()) / (1 << 20));
    return;
  }
  // The same initial values as fsdp-train's: its shards are materialised from this function too.
  llama::LlamaForCausalLM model(cfg.model, at::kMeta);
  fsdp::init::materialize(*model, llama::llama_init_fn(cfg.model, cfg.train.seed));
  c10::Device device(cfg.fsdp.device);
  if (!device.is_cpu() && !device.has_index()) device = c10::Device(device.type(), 0);  // one process: device 0
  const at::ScalarType compute = cfg.fsdp.param_dtype;
  std::vector<at::Tensor> masters;  // fp32, on the device, before the model is cast
  if (compute != at::kFloat) {
    for (const auto& p : llama::unique_parameters(*model))
      masters.push_back(p.detach().to(device, at::kFloat, false, true));
  }
  model->to(device, compute);
  const auto& o = cfg.optim;
  std::vector<ParamState> states;
  for (const auto& p : llama::unique_parameters(*model)) {
    ParamState s;
    s.param = p;
    s.master = masters.empty() ? p : masters.at(states.size());
    s.exp_avg = at::zeros_like(s.master);
    s.exp_avg_sq = at::zeros_like(s.master);
    s.weight_decay = fsdp::default_param_group("", p) == 0 ? o.weight_decay : 0.0;
    states.push_back(std::move(s));
  }
  const int64_t batch = cfg.data.batch_size_per_rank;
  double total_s = 0;
  for (int64_t step = 0; step < cfg.train.steps; ++step) {
    const auto t0 = Clock::now();
    // The same parts as fsdp-train's phase_s, each timed from the end of the one before.
    auto since = [last = t0]() mutable {
      const auto now = Clock::now();
      const double s = std::chrono::duration<double>(now - last).count();
      last = now;
      return s;
    };
    const double lr = lr_at(o, step, cfg.train.steps);
    const auto b = train::rank_batch(data, step * batch, batch, 0, train::Split::kTrain);
    const auto inputs = b.inputs.to(device), targets = b.targets.to(device);
    const double data_s = since();
    auto loss = llama::loss(model->forward(inputs), targets);
    const double forward_s = since();
    loss.backward();
    const double backward_s = since();
    const auto grads = fp32_grads(states);
    if (o.grad_clip > 0) clip_grad_norm(grads, o.grad_clip, device);
    const double clip_s = since();
    adamw_step(states, grads, o, lr);
    for (auto& s : states) s.param.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
    const double optimizer_s = since();
    const double loss_value = loss.item<double>();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    total_s += dt;
    const auto [peak_allocated, peak_reserved] = device_peaks(device);
    if (metrics != nullptr) {
      nlohmann::json line = {{"step", step + 1},
                             {"loss", loss_value},
                             {"lr", lr},
                             {"step_time_s", dt},
                             {"tokens_per_s", static_cast<double>(batch * cfg.data.seq_len) / dt},
                             {"allgather_bytes", {0.0}},
                             {"reduce_scatter_bytes", {0.0}},
                             {"comm_wait_s", {0.0}},
                             {"peak_rss_bytes", {static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes())}},
                             {"phase_s",
                              {{"data", data_s},
                               {"forward", forward_s},
                               {"backward", backward_s},
                               {"clip", clip_s},
                               {"optimizer", optimizer_s}}}};
      if (!device.is_cpu()) {
        line["peak_device_allocated_bytes"] = {peak_allocated};
        line["peak_device_reserved_bytes"] = {peak_reserved};
      }
      write_line(metrics, line);
    }
  }
  if (metrics != nullptr) std::fclose(metrics);
  std::printf("bench_unsharded: %lld steps in %.2f s, peak RSS %.1f MiB\n", static_cast<long long>(cfg.train.steps),
              total_s, static_cast<double>(fsdp::sysinfo::lifetime_peak_rss_bytes()) / (1 << 20));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<const char*> args(argv, argv + argc);
    const Extra extra = take_extra_flags(args);
    const auto flags = train::parse_flags(static_cast<int>(args.size()), args.data());
    const auto cfg = train::config_from_flags(flags);
    const train::Dataset data(cfg.data, cfg.model.vocab_size, cfg.train.seed);
    if (!extra.dump_path.empty()) {
      dump_batches(cfg, data, extra);
      return 0;
    }
    int threads = 1;
    if (const char* env = std::getenv("FSDP_THREADS")) threads = std::max(1, std::atoi(env));
    at::set_num_threads(threads);
    train_unsharded(cfg, flags, data, extra.init_only);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_unsharded: error: %s\n", e.what());
    return 1;
  }
}
