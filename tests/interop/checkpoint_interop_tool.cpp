// checkpoint_interop_tool: a small command line over fsdp::checkpoint, so that
// tests/interop/checkpoint_interop_test.py can check whole sharded checkpoints against the Python
// `safetensors` package in both directions.
//   checkpoint_interop_tool write DIR   trains a sharded testing::Net on 2 ranks (threads of this
//                                       process) for 2 AdamW steps and saves DIR/step-00000002;
//                                       then trains an unsharded reference Net with the same math
//                                       and writes DIR/expected.json from it (see below)
//   checkpoint_interop_tool read DIR    loads checkpoint DIR into a plain unsharded Net with
//                                       load_unsharded and prints "name sum wsum" per parameter
// The expected values come from the reference, not from our loader, so a checkpoint that stores
// a shard at the wrong offset or under the wrong name cannot agree with them by construction.
//
// expected.json (wsum: element i weighted by (i % 7) + 1):
//                {"net": {in, dim, hidden, out, blocks},
//                 "tensors": {name: {"shape": [...], "sum": f64, "wsum": f64, "first": [4 values],
//                                    "exp_avg_sum": f64, "exp_avg_first": [4 values]}}}
// Errors go to stderr with exit status 1 (2 for bad usage).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "support/models.h"

namespace {

using fsdp::testing::Net;
using fsdp::testing::NetOptions;

constexpr int kWorld = 2;
constexpr int kSteps = 2;
constexpr int64_t kGlobalBatch = 12;
constexpr double kLr = 1e-2;
constexpr double kWeightDecay = 1e-2;  // AdamWOptions' default; the default param groups decay dim >= 2 only

// Kept in step with NET in checkpoint_interop_test.py.
NetOptions net_options() {
  NetOptions o;
  o.in = 7, o.dim = 15, o.hidden = 13, o.out = 5, o.blocks = 2;
  return o;
}

fsdp::ParamInitFn net_init() { return fsdp::init::normal(0.2, 5); }

// The global batch of step `s`; rank r trains on rows [r * 12/N, (r+1) * 12/N).
std::pair<at::Tensor, at::Tensor> batch(int s, const NetOptions& o) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + s);
  auto x = at::randn({kGlobalBatch, o.in}, gen);
  auto y = at::randn({kGlobalBatch, o.out}, gen);
  return {x, y};
}

// Ranks as threads over a FileStore on a temp file (the run_threads tier of tests/support, without
// gtest). Throws the first rank's error, naming the rank.
void run_ranks(int world, const std::function<void(std::shared_ptr<fsdp::Dist>)>& fn) {
  const std::string path = "/tmp/fsdp-interop-store-" + std::to_string(::getpid());
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::string> errors;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, world);
        auto dist = fsdp::Dist::from_store(store, r, world, fsdp::InitOptions().timeout(std::chrono::seconds(60)));
        fn(dist);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  ::unlink(path.c_str());
  if (!errors.empty()) throw std::runtime_error(errors.front());
}

void write_sharded(const std::string& dir) {
  run_ranks(kWorld, [&](std::shared_ptr<fsdp::Dist> dist) {
    fsdp::DeviceMesh mesh(dist);
    NetOptions o = net_options();
    o.device = at::kMeta;
    Net model(o);
    auto opts = fsdp::FullyShardOptions().init(net_init());
    for (auto& b : model->blocks) fsdp::fully_shard(b, mesh, opts);
    auto root = fsdp::fully_shard(model, mesh, opts);
    fsdp::AdamW optim(root, fsdp::AdamWOptions(kLr).weight_decay(kWeightDecay));
    const int64_t local = kGlobalBatch / dist->world_size();
    const int64_t begin = dist->rank() * local;
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = batch(s, o);
      at::mse_loss(fsdp::call(model, x.narrow(0, begin, local)), y.narrow(0, begin, local)).backward();
      optim.step();
      optim.zero_grad();
    }
    fsdp::checkpoint::TrainState st;
    st.step = kSteps;
    st.samples_seen = kSteps * kGlobalBatch;
    fsdp::checkpoint::save(dir, "step-00000002", *root, &optim, st);
  });
}

nlohmann::json first_values(const at::Tensor& t) {
  auto flat = t.detach().reshape({-1}).to(at::kDouble);
  nlohmann::json out = nlohmann::json::array();
  for (int64_t i = 0; i < std::min<int64_t>(4, flat.numel()); ++i) out.push_back(flat[i].item<double>());
  return out;
}

double sum64(const at::Tensor& t) { return t.detach().to(at::kDouble).sum().item<double>(); }

// Element i (row-major) weighted by (i % 7) + 1, so a misplaced element changes it.
double weighted_sum64(const at::Tensor& t) {
  auto flat = t.detach().reshape({-1}).to(at::kDouble);
  auto w = at::remainder(at::arange(flat.numel(), at::kDouble), 7) + 1;
  return (flat * w).sum().item<double>();
}

// The same model, data and AdamW update as write_sharded, on whole unsharded parameters and the
// whole global batch (the mean of the ranks' equal-sized local means is the global mean).
nlohmann::json reference_expected() {
  NetOptions o = net_options();
  o.device = at::kMeta;
  Net ref(o);
  fsdp::init::materialize(*ref, net_init());
  std::vector<at::Tensor> params;
  for (auto& p : ref->parameters()) params.push_back(p);
  std::vector<at::Tensor> exp_avg, exp_avg_sq;
  for (auto& p : params) exp_avg.push_back(at::zeros_like(p)), exp_avg_sq.push_back(at::zeros_like(p));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s, o);
    at::mse_loss(ref->forward(x), y).backward();
    c10::NoGradGuard no_grad;
    const double step = s + 1;
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      const auto g = p.grad();
      if (p.dim() >= 2) p.mul_(1 - kLr * kWeightDecay);
      exp_avg[i].lerp_(g, 0.1);
      exp_avg_sq[i].mul_(0.999).addcmul_(g, g, 0.001);
      p.addcdiv_(exp_avg[i], (exp_avg_sq[i].sqrt() / std::sqrt(bc2)).add_(1e-8), -kLr / bc1);
      p.mutable_grad() = at::Tensor();
    }
  }
  nlohmann::json out;
  out["net"] = {{"in", o.in}, {"dim", o.dim}, {"hidden", o.hidden}, {"out", o.out}, {"blocks", o.blocks}};
  out["tensors"] = nlohmann::json::object();
  size_t i = 0;
  for (const auto& item : ref->named_parameters()) {
    const auto& p = item.value();
    out["tensors"][item.key()] = {{"shape", p.sizes().vec()},         {"sum", sum64(p)},
                                  {"wsum", weighted_sum64(p)},        {"first", first_values(p)},
                                  {"exp_avg_sum", sum64(exp_avg[i])}, {"exp_avg_first", first_values(exp_avg[i])}};
    ++i;
  }
  return out;
}

int cmd_write(const std::string& dir) {
  fsdp::io::make_dirs(dir);
  write_sharded(dir);
  std::ofstream(fsdp::io::join(dir, "expected.json")) << reference_expected().dump(2) << "\n";
  std::printf("wrote %s\n", fsdp::io::join(dir, "step-00000002").c_str());
  return 0;
}

int cmd_read(const std::string& dir) {
  Net net(net_options());
  fsdp::checkpoint::load_unsharded(dir, *net);
  for (const auto& item : net->named_parameters()) {
    std::printf("%s %.17g %.17g\n", item.key().c_str(), sum64(item.value()), weighted_sum64(item.value()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  if (argc != 3 || (std::string(argv[1]) != "write" && std::string(argv[1]) != "read")) {
    std::fprintf(stderr, "usage: checkpoint_interop_tool write DIR | read DIR\n");
    return 2;
  }
  try {
    return std::string(argv[1]) == "write" ? cmd_write(argv[2]) : cmd_read(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_interop_tool: %s\n", e.what());
    return 1;
  }
}
