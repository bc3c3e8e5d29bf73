// Collective benchmark: fsdp's all-gather, reduce-scatter and all-reduce over its two CPU hops
// (impl "shm": shared memory between the ranks of this host, the default; "ring": the same rings
// over Gloo point-to-point, what ranks on different hosts use) against ProcessGroupGloo's own
// (_allgather_base, _reduce_scatter_base, allreduce; impl "gloo"), over buffer sizes from 64 KiB to
// 64 MiB, interleaved in one run. Run one process per rank (fsdp-run). Rank 0 writes a JSON list of
// records to --out.
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
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator_impl.h"
#include "comm/transport.h"
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
  if (std::string(comm.backend_name()) != "shm") {
    std::fprintf(stderr, "bench_collectives: the world group runs over %s, not shared memory\n", comm.backend_name());
    return 1;
  }
  fsdp::CpuTransportOptions ropts;
  ropts.timeout = std::chrono::seconds(120);
  ropts.hostname = "127.0.0.1";
  ropts.mode = "gloo";
  fsdp::CommunicatorOptions copts;
  copts.name = "ring";
  copts.timeout = ropts.timeout;
  auto ring = fsdp::make_communicator(
      fsdp::make_cpu_transport(c10::make_intrusive<c10d::PrefixStore>("bench/ring", dist->store()), rank, n, ropts),
      copts);

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
    // impl -> op -> times; impls interleaved in every iteration.
    std::map<std::string, std::map<std::string, std::vector<double>>> times;
    comm.reset_stats();
    ring->reset_stats();
    for (int it = 0; it < iters + 2; ++it) {  // two warm-up iterations
      auto time = [&](const char* impl, const char* op, auto&& fn) {
        comm.barrier("bench");
        const auto t0 = Clock::now();
        fn();
        if (it >= 2) times[impl][op].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      };
      for (auto* c : {&comm, ring.get()}) {
        const char* impl = c == &comm ? "shm" : "ring";
        time(impl, "all_gather", [&] { c->all_gather(full, part, "ag").wait(); });
        auto scratch = full.clone();
        time(impl, "reduce_scatter", [&] { c->reduce_scatter(part, scratch, fsdp::ReduceOp::kSum, "rs").wait(); });
        time(impl, "all_reduce", [&] { c->all_reduce(scratch, fsdp::ReduceOp::kSum, "ar").wait(); });
      }
      time("gloo", "all_gather", [&] { gloo->_allgather_base(full, part)->wait(); });
      time("gloo", "reduce_scatter", [&] { gloo->_reduce_scatter_base(part, full)->wait(); });
      std::vector<at::Tensor> ar{full.clone()};
      time("gloo", "all_reduce", [&] { gloo->allreduce(ar)->wait(); });
    }
    const double calls = iters + 2;
    const double S = numel * 4.0;
    auto add = [&](const char* op, const char* impl, double sent) {
      const double t = median(times[impl][op]);
      const double algbw = S / t;
      records.push_back({{"op", op},
                         {"impl", impl},
                         {"world_size", n},
                         {"bytes_per_rank_buffer", (int64_t)S},
                         {"bytes_sent_per_rank", (int64_t)sent},
                         {"time_s", t},
                         {"algbw", algbw},
                         {"busbw", algbw * (std::string(op) == "all_reduce" ? 2.0 : 1.0) * (n - 1) / n},
                         {"iterations", iters}});
    };
    for (auto* c : {&comm, ring.get()}) {
      const char* impl = c == &comm ? "shm" : "ring";
      const auto stats = c->stats();
      add("all_gather", impl, stats.of(fsdp::CollectiveKind::kAllGather).bytes_sent / calls);
      add("reduce_scatter", impl, stats.of(fsdp::CollectiveKind::kReduceScatter).bytes_sent / calls);
      add("all_reduce", impl, stats.of(fsdp::CollectiveKind::kAllReduce).bytes_sent / calls);
    }
    add("all_gather", "gloo", S * (n - 1) / n);
    add("reduce_scatter", "gloo", 2 * S * (n - 1) / n);
    add("all_reduce", "gloo", 2 * S * (n - 1) / n);
    if (rank == 0) {
      std::printf("N=%d buffer %8.0f KiB", n, S / 1024);
      for (const char* op : {"all_gather", "reduce_scatter", "all_reduce"}) {
        std::printf("  %s shm %.4f ring %.4f gloo %.4f s", op, median(times["shm"][op]), median(times["ring"][op]),
                    median(times["gloo"][op]));
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (rank == 0) {
    std::ofstream(out_path) << records.dump(2) << "\n";
  }
  comm.barrier("done");
  return 0;
}
