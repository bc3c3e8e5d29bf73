// Collective benchmark: fsdp's all-gather and reduce-scatter against ProcessGroupGloo's own
// (_allgather_base, _reduce_scatter_base) over buffer sizes from 64 KiB to 64 MiB, in one run.
// Run one process per rank (fsdp-run). Rank 0 writes a JSON list of records to --out.
//
// Figures follow nccl-tests: for a buffer of S bytes (the full, unsharded buffer), time t (median
// over iterations, each started after a barrier), algbw = S / t and busbw = algbw * (N-1)/N.
// bytes_sent_per_rank: ours from the communicator's counters; Gloo's from its algorithm (a ring
// all-gather sends (N-1)/N of S; its reduce-scatter is an all-reduce, 2(N-1)/N of S).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdp/dist.h"

namespace {
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "bench/results/collectives-partial.json";
  int64_t min_bytes = 64 << 10, max_bytes = 64 << 20;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--max-bytes" && i + 1 < argc) max_bytes = std::stoll(argv[++i]);
    else if (a == "--min-bytes" && i + 1 < argc) min_bytes = std::stoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_collectives [--out FILE] [--min-bytes B] [--max-bytes B]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  auto dist = fsdp::init_from_env(fsdp::InitOptions().timeout(std::chrono::seconds(120)));
  const int n = dist->world_size(), rank = dist->rank();
  auto& comm = dist->world();

  auto gopts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
  gopts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("bench/gloo", dist->store()), rank, n, gopts);

  nlohmann::json records = nlohmann::json::array();
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int64_t numel = bytes / 4 / n * n;  // fp32, divisible by the world size
    const int64_t shard = numel / n;
    const int iters = static_cast<int>(std::clamp<int64_t>((256 << 20) / bytes, 5, 30));
    auto full = at::randn({numel});
    auto part = at::randn({shard});
    std::vector<double> t_ours_ag, t_gloo_ag, t_ours_rs, t_gloo_rs;
    comm.reset_stats();
    for (int it = 0; it < iters + 2; ++it) {  // two warm-up iterations, interleaved impls
      auto time = [&](auto&& fn, std::vector<double>& into) {
        comm.barrier("bench");
        const auto t0 = Clock::now();
        fn();
        if (it >= 2) into.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      };
      time([&] { comm.all_gather(full, part, "ag").wait(); }, t_ours_ag);
      time([&] { gloo->_allgather_base(full, part)->wait(); }, t_gloo_ag);
      auto scratch = full.clone();
      time([&] { comm.reduce_scatter(part, scratch, fsdp::ReduceOp::kSum, "rs").wait(); }, t_ours_rs);
      time([&] { gloo->_reduce_scatter_base(part, full)->wait(); }, t_gloo_rs);
    }
    const auto stats = comm.stats();
    const double calls = iters + 2;
    const double S = numel * 4.0;
    auto add = [&](const char* op, const char* impl, double sent, double t) {
      const double algbw = S / t;
      records.push_back({{"op", op},
                         {"impl", impl},
                         {"world_size", n},
                         {"bytes_per_rank_buffer", (int64_t)S},
                         {"bytes_sent_per_rank", (int64_t)sent},
                         {"time_s", t},
                         {"algbw", algbw},
                         {"busbw", algbw * (n - 1) / n},
                         {"iterations", iters}});
    };
    add("all_gather", "fsdp", stats.of(fsdp::CollectiveKind::kAllGather).bytes_sent / calls, median(t_ours_ag));
    add("all_gather", "gloo", S * (n - 1) / n, median(t_gloo_ag));
    add("reduce_scatter", "fsdp", stats.of(fsdp::CollectiveKind::kReduceScatter).bytes_sent / calls, median(t_ours_rs));
    add("reduce_scatter", "gloo", 2 * S * (n - 1) / n, median(t_gloo_rs));
    if (rank == 0) {
      std::printf(
          "N=%d buffer %8.0f KiB  all_gather fsdp %.4f s gloo %.4f s | reduce_scatter fsdp %.4f s gloo %.4f s\n", n,
          S / 1024, median(t_ours_ag), median(t_gloo_ag), median(t_ours_rs), median(t_gloo_rs));
      std::fflush(stdout);
    }
  }
  if (rank == 0) {
    std::ofstream(out_path) << records.dump(2) << "\n";
  }
  comm.barrier("done");
  return 0;
}
