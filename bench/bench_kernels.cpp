// Kernel benchmark: each op of kernels/ops.h on flat buffers of several sizes, with the bytes its
// contract makes it move counted per element (AdamW fp32: reads p, g, m, v and writes p, m, v =
// 28 B; +2 B for a bf16 param copy), its achieved bandwidth, and in the same run the bandwidth of
// a memcpy moving the same number of bytes (half read, half written) with the same thread count:
// ratio = op GB/s / memcpy GB/s, the share of the machine's copy bandwidth the op reaches. The
// unfused ATen sequence the op replaces is timed too (speedup = ATen time / op time).
// On a GPU (CUDA build with a device) the same rows run on the device against a device-to-device
// copy of the same bytes. Writes JSON (--json) and a markdown table (--markdown).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/cpu/twins.h"
#include "kernels/ops.h"

#if FSDP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {
using Clock = std::chrono::steady_clock;
namespace k = fsdp::kernels;

void sync(bool cuda) {
#if FSDP_WITH_CUDA
  if (cuda) c10::cuda::device_synchronize();
#else
  (void)cuda;
#endif
}

// Median seconds of `reps` runs after one warm-up.
double time_median(const std::function<void()>& f, int reps, bool cuda) {
  f();
  sync(cuda);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    sync(cuda);
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Op {
  std::string name;
  double bytes_per_elem;  // by the op's contract
  std::function<void()> run;
  std::function<void()> aten;  // the unfused ATen equivalent
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "bench/results/kernels.json", md_path = "bench/results/kernels.md";
  std::vector<int64_t> sizes = {1 << 16, 1 << 20, 1 << 24};
  int reps = 9;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--markdown" && i + 1 < argc) md_path = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    else if (a == "--quick") sizes = {1 << 12, 1 << 16};
    else {
      std::fprintf(stderr, "usage: bench_kernels [--json PATH] [--markdown PATH] [--reps N] [--quick]\n");
      return 2;
    }
  }
  const bool gpu = k::cuda_kernels_built() && at::hasCUDA();
  std::vector<std::pair<std::string, int>> configs;  // device, threads
  for (int threads : {1, 2}) configs.emplace_back("cpu", threads);
  if (gpu) configs.emplace_back("cuda", 0);

  nlohmann::json rows = nlohmann::json::array();
  for (const auto& [device, threads] : configs) {
    const bool cuda = device == "cuda";
    if (!cuda) at::set_num_threads(threads);
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(cuda ? at::kCUDA : at::kCPU);
    for (int64_t n : sizes) {
      at::manual_seed(n);
      auto p = at::randn({n}, opts), g = at::randn({n}, opts) * 0.1, m = at::randn({n}, opts) * 0.01;
      auto v = at::rand({n}, opts) * 1e-3;
      auto bf16 = at::empty({n}, opts.dtype(at::kBFloat16)), g32 = at::empty({n}, opts);
      auto sq = at::zeros({1}, opts.dtype(at::kDouble));
      k::AdamWArgs a;
      a.lr = 1e-4;  // small steps: many repetitions keep the values in range
      a.weight_decay = 0.1;
      a.step = 10;
      const double bc1 = 1 - std::pow(a.beta1, 10.0), bc2 = 1 - std::pow(a.beta2, 10.0);
      auto aten_adamw = [&] {
        p.mul_(1 - a.lr * a.weight_decay);
        m.lerp_(g, 1 - a.beta1);
        v.mul_(a.beta2).addcmul_(g, g, 1 - a.beta2);
        p.addcdiv_(m, (v.sqrt() / std::sqrt(bc2)).add_(a.eps), -a.lr / bc1);
      };
      std::vector<Op> ops = {
          {"adamw", 28, [&] { k::fused_adamw(a, p, g, m, v); }, aten_adamw},
          {"adamw+bf16 copy", 30, [&] { k::fused_adamw(a, p, g, m, v, bf16); },
           [&] {
             aten_adamw();
             bf16.copy_(p);
           }},
          {"copy_in fp32->bf16", 6, [&] { k::copy_in(p, bf16); }, [&] { bf16.copy_(p); }},
          {"copy_out bf16->fp32", 6, [&] { k::copy_out(bf16, g32); }, [&] { g32.copy_(bf16); }},
          {"copy_out bf16->fp32 +=", 10,
           [&] {
             k::copy_out(bf16, g32, {1.0, true});
           },
           [&] { g32.add_(bf16); }},
          {"sum_of_squares", 4, [&] { k::sum_of_squares(g, sq); }, [&] { sq.add_(g.to(at::kDouble).pow(2).sum()); }},
          {"scale_", 8, [&] { k::scale_(g32, 1.0000001); }, [&] { g32.mul_(1.0000001); }},
      };
      for (const auto& op : ops) {
        const double bytes = op.bytes_per_elem * static_cast<double>(n);
        // The baseline: a copy moving the same bytes (bytes/2 read, bytes/2 written), same threads.
        const int64_t half = static_cast<int64_t>(bytes / 2);
        auto src = at::empty({half}, opts.dtype(at::kByte)).fill_(1), dst = at::empty({half}, opts.dtype(at::kByte));
        auto* s = static_cast<const char*>(src.data_ptr());
        auto* d = static_cast<char*>(dst.data_ptr());
        auto copy = cuda ? std::function<void()>([&] { dst.copy_(src); }) : std::function<void()>([&] {
          at::parallel_for(0, half, 1 << 20,
                           [&](int64_t b, int64_t e) { std::memcpy(d + b, s + b, static_cast<size_t>(e - b)); });
        });
        const double t_op = time_median(op.run, reps, cuda);
        const double t_copy = time_median(copy, reps, cuda);
        const double t_aten = time_median(op.aten, reps, cuda);
        const double gbs = bytes / t_op / 1e9, copy_gbs = bytes / t_copy / 1e9;
        rows.push_back({{"device", device},
                        {"capability", cuda ? "cuda" : fsdp::kernels::cpu::capability()},
                        {"threads", threads},
                        {"op", op.name},
                        {"elements", n},
                        {"bytes_per_element", op.bytes_per_elem},
                        {"bytes", bytes},
                        {"time_s", t_op},
                        {"gbps", gbs},
                        {"memcpy_time_s", t_copy},
                        {"memcpy_gbps", copy_gbs},
                        {"ratio_to_memcpy", gbs / copy_gbs},
                        {"aten_time_s", t_aten},
                        {"speedup_vs_aten", t_aten / t_op}});
        std::fprintf(stderr, "%s t=%d %-24s n=%-9lld %.2f GB/s (memcpy %.2f GB/s) ATen x%.2f\n", device.c_str(),
                     threads, op.name.c_str(), static_cast<long long>(n), gbs, copy_gbs, t_aten / t_op);
      }
    }
  }

  std::ofstream(json_path) << rows.dump(1) << "\n";
  std::ofstream md(md_path);
  md << "# Kernel bandwidth\n\n"
     << "Bytes counted from each op's contract (kernels/ops.h); GB/s = bytes / median time. memcpy moves\n"
     << "the same bytes (half read, half written) with the same threads, in the same run; ratio = op GB/s /\n"
     << "memcpy GB/s. ATen x = time of the unfused ATen ops it replaces / time of the op. CPU twins: "
     << fsdp::kernels::cpu::capability() << " build. Regenerate with `scripts/bench kernels`.\n\n"
     << "| device | threads | op | elements | B/elem | MiB moved | time | GB/s | memcpy GB/s | ratio | ATen x |\n"
     << "|---|---|---|---|---|---|---|---|---|---|---|\n";
  char line[512];
  for (const auto& r : rows) {
    std::snprintf(line, sizeof(line), "| %s | %s | %s | %lld | %g | %.2f | %.3f ms | %.2f | %.2f | %.2f | %.2f |\n",
                  r["device"].get<std::string>().c_str(),
                  r["device"] == "cuda" ? "-" : std::to_string(r["threads"].get<int>()).c_str(),
                  r["op"].get<std::string>().c_str(), static_cast<long long>(r["elements"].get<int64_t>()),
                  r["bytes_per_element"].get<double>(), r["bytes"].get<double>() / (1 << 20),
                  r["time_s"].get<double>() * 1e3, r["gbps"].get<double>(), r["memcpy_gbps"].get<double>(),
                  r["ratio_to_memcpy"].get<double>(), r["speedup_vs_aten"].get<double>());
    md << line;
  }
  return 0;
}
