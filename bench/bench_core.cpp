// Communication volume and per-rank memory of sharded Llama training against the ZeRO-3 model.
// One process per rank (fsdp-run). For a few training steps it reads the communicator's byte
// counters and the memory report, and compares them with
//   bytes sent per step and rank:  3 * Psi * b * (N-1)/N   (all-gather fwd + bwd, reduce-scatter)
//   model state per rank:          16 * Psi / N            (fp32 params + grads + AdamW's 2 states)
// Rank 0 prints one JSON object per run (all ranks' figures) to stdout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "fsdp/fsdp.h"
#include "llama.h"

int main(int argc, char** argv) {
  llama::LlamaConfig cfg;
  cfg.vocab_size = 512, cfg.hidden_size = 256, cfg.intermediate_size = 688, cfg.num_hidden_layers = 4;
  cfg.num_attention_heads = 8, cfg.num_key_value_heads = 4, cfg.max_position_embeddings = 256;
  int64_t seq = 64, batch = 1;
  bool root_reshard = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::stoll(argv[++i]); };
    if (a == "--hidden" && i + 1 < argc) cfg.hidden_size = next(), cfg.intermediate_size = cfg.hidden_size * 8 / 3;
    else if (a == "--layers" && i + 1 < argc) cfg.num_hidden_layers = next();
    else if (a == "--seq" && i + 1 < argc) seq = next();
    else if (a == "--batch" && i + 1 < argc) batch = next();
    else if (a == "--root-reshard") root_reshard = true;
    else {
      std::fprintf(stderr, "usage: bench_core [--hidden H] [--layers L] [--seq T] [--batch B] [--root-reshard]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  auto dist = fsdp::init_from_env();
  fsdp::DeviceMesh mesh(dist);
  const int n = dist->world_size();

  llama::LlamaForCausalLM model(cfg, at::kMeta);
  int64_t psi = 0;
  for (auto& p : llama::unique_parameters(*model)) psi += p.numel();
  auto opts = fsdp::FullyShardOptions().init(llama::llama_init_fn(cfg, 1234));
  for (auto& layer : model->model->layers) fsdp::fully_shard(layer, mesh, opts);
  auto root_opts = opts;
  if (root_reshard) root_opts.reshard_after_forward(true);
  auto root = fsdp::fully_shard(model, mesh, root_opts);
  fsdp::AdamW optim(root, fsdp::AdamWOptions(1e-3));

  auto& comm = dist->world();
  fsdp::CommStats step_bytes;
  for (int step = 0; step < 3; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(step + 1);
    auto tokens = at::randint(cfg.vocab_size, {batch, seq + 1}, gen);
    const auto before = comm.stats();
    auto loss = llama::loss(fsdp::call(model, tokens.narrow(1, 0, seq)), tokens.narrow(1, 1, seq));
    loss.backward();
    optim.step();
    optim.zero_grad();
    step_bytes = comm.stats() - before;
  }
  const auto report = fsdp::memory_report(*root, &optim);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double mine[] = {double(step_bytes.of(fsdp::CollectiveKind::kAllGather).bytes_sent),
                         double(step_bytes.of(fsdp::CollectiveKind::kReduceScatter).bytes_sent),
                         double(report.model_state()), double(report.peak_unsharded), ru.ru_maxrss * 1024.0};
  auto all = at::zeros({n * 5}, at::kDouble);
  comm.all_gather(all, at::tensor(at::ArrayRef<double>(mine, 5), at::kDouble), "report").wait();
  if (dist->rank() == 0) {
    nlohmann::json out;
    out["world_size"] = n;
    out["psi"] = psi;
    out["root_reshard_after_forward"] = root_reshard;
    out["zero3_bytes_per_step"] = 3.0 * psi * 4 * (n - 1) / n;
    out["zero3_model_state_bytes"] = 16.0 * psi / n;
    for (int r = 0; r < n; ++r) {
      auto v = all.narrow(0, 5 * r, 5);
      out["ranks"].push_back({{"all_gather_bytes", v[0].item<double>()},
                              {"reduce_scatter_bytes", v[1].item<double>()},
                              {"model_state_bytes", v[2].item<double>()},
                              {"peak_unsharded_bytes", v[3].item<double>()},
                              {"peak_rss_bytes", v[4].item<double>()}});
    }
    std::printf("%s\n", out.dump().c_str());
  }
  comm.barrier("done");
  return 0;
}
