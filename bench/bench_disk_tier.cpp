// The disk tier's speed against training in memory, in one run: the same Llama model trained on
// every rank (fsdp-run) in four modes, alternating round after round: everything in memory with
// the optimizer stepping after backward and in backward (ShardedOptimizer::step_in_backward), then
// the fp32 master shards and AdamW state in the disk tier, stepping after backward and in
// backward. The steps after backward clip the gradients' global norm (--clip, 1.0 by default as in
// fsdp-train; 0 turns it off), as most training runs do. Before every disk-tier step the page cache of the tier's files
// is dropped (POSIX_FADV_DONTNEED), so its reads come from the disk. Per mode: the median step time over the steps
// after the first of each round; the ratio is the disk tier (in backward) over the faster of the two in-memory modes.
// For the disk tier also the bytes its I/O threads read and wrote per step against the state's size (master + AdamW
// state per rank, read once and written once) and against the plan (offload_plan: what the schedule must move). Every
// mode's losses must agree (the same work), else the run fails. Rank 0 prints one JSON object (all ranks' figures);
// --trace writes each rank's trace of the disk tier in backward (trace_report.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "fsdp/offload.h"
#include "llama.h"
#include "shard/testing.h"  // drop_disk_tier_page_cache: a benchmark switch, not installed

namespace {

struct Options {
  llama::LlamaConfig cfg;
  int64_t seq = 64, batch = 1, steps = 5, rounds = 2, budget = 64 << 20;
  double clip = 1.0;  // max gradient norm of the steps after backward (fsdp-train's default); 0: off
  std::string dir = "/tmp/fsdp-bench-disk-tier", trace;
};

struct Result {
  std::vector<double> step_s;
  std::vector<double> losses;  // the last round's
  fsdp::OffloadIo io;          // summed over the measured steps
  int64_t measured = 0;
  fsdp::OffloadPlan plan;
  int64_t state_bytes = 0;  // master + AdamW state on this rank
};

void train(const Options& o, fsdp::DeviceMesh& mesh, bool disk, bool in_backward, int round, Result& r) {
  llama::LlamaForCausalLM model(o.cfg, at::kMeta);
  auto opts = fsdp::FullyShardOptions().init(llama::llama_init_fn(o.cfg, 1234));
  for (auto& layer : model->model->layers) fsdp::fully_shard(layer, mesh, opts);
  auto root_opts = opts;
  if (disk) {
    root_opts.offload(fsdp::OffloadPolicy()
                          .params(fsdp::OffloadTier::kDisk)
                          .optimizer_state(fsdp::OffloadTier::kDisk)
                          .dir(o.dir + "/rank" + std::to_string(mesh.dist().rank()))
                          .memory_budget_bytes(o.budget));
  }
  auto root = fsdp::fully_shard(model, mesh, root_opts);
  fsdp::AdamW optim(root, fsdp::AdamWOptions(1e-3));
  optim.step_in_backward(in_backward);
  std::shared_ptr<fsdp::Tracer> tracer;
  r.losses.clear();
  if (!o.trace.empty() && disk && in_backward && round == 0) {
    tracer = std::make_shared<fsdp::Tracer>(mesh.dist().rank());
    root->set_tracer(tracer);
  }
  for (int64_t step = 0; step < o.steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(step + 1);
    auto tokens = at::randint(o.cfg.vocab_size, {o.batch, o.seq + 1}, gen);
    if (disk) fsdp::drop_disk_tier_page_cache(*root);  // the step reads from the disk
    mesh.dist().world().barrier("bench step");
    const auto io_before = fsdp::offload_io(*root);
    const auto t0 = std::chrono::steady_clock::now();
    {
      fsdp::Tracer::Scope s(tracer.get(), "train::step", "train", "");
      auto loss = llama::loss(fsdp::call(model, tokens.narrow(1, 0, o.seq)), tokens.narrow(1, 1, o.seq));
      loss.backward();
      if (!in_backward && o.clip > 0) fsdp::clip_grad_norm(*root, o.clip);
      optim.step();
      optim.zero_grad();
      r.losses.push_back(loss.item<double>());
    }
    mesh.dist().world().barrier("bench step end");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step == 0) continue;  // the first step records the execution order and creates the state
    r.step_s.push_back(s);
    const auto moved = fsdp::offload_io(*root) - io_before;
    r.io.disk_read += moved.disk_read;
    r.io.disk_write += moved.disk_write;
    ++r.measured;
  }
  if (disk) r.plan = fsdp::offload_plan(*root, optim);
  const auto report = fsdp::memory_report(*root, &optim);
  r.state_bytes = report.sharded_params + report.optimizer_state;
  if (tracer) tracer->write(o.trace + ".rank" + std::to_string(mesh.dist().rank()) + ".json");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  auto& c = o.cfg;
  c.vocab_size = 256, c.hidden_size = 512, c.intermediate_size = 1536, c.num_hidden_layers = 8;
  c.num_attention_heads = 8, c.num_key_value_heads = 8, c.max_position_embeddings = 4096;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--hidden" && has) c.hidden_size = std::stoll(argv[++i]);
    else if (a == "--intermediate" && has) c.intermediate_size = std::stoll(argv[++i]);
    else if (a == "--layers" && has) c.num_hidden_layers = std::stoll(argv[++i]);
    else if (a == "--seq" && has) o.seq = std::stoll(argv[++i]);
    else if (a == "--batch" && has) o.batch = std::stoll(argv[++i]);
    else if (a == "--steps" && has) o.steps = std::stoll(argv[++i]);
    else if (a == "--rounds" && has) o.rounds = std::stoll(argv[++i]);
    else if (a == "--budget" && has) o.budget = std::stoll(argv[++i]);
    else if (a == "--clip" && has) o.clip = std::stod(argv[++i]);
    else if (a == "--dir" && has) o.dir = argv[++i];
    else if (a == "--trace" && has) o.trace = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: bench_disk_tier [--hidden H] [--intermediate I] [--layers L] [--seq T] [--batch B] "
                   "[--steps S] [--rounds R] [--budget BYTES] [--clip MAX_NORM] [--dir DIR] [--trace PREFIX]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  auto dist = fsdp::init_from_env();
  fsdp::DeviceMesh mesh(dist);
  Result memory, memory_ib, disk_after, disk;
  for (int64_t round = 0; round < o.rounds; ++round) {
    train(o, mesh, false, false, static_cast<int>(round), memory);
    train(o, mesh, false, true, static_cast<int>(round), memory_ib);
    train(o, mesh, true, false, static_cast<int>(round), disk_after);
    train(o, mesh, true, true, static_cast<int>(round), disk);
  }
  // The same work in the modes that step alike: the losses agree (the step in backward is bitwise
  // the same as the step after backward; the steps after backward clip, those in backward cannot).
  const std::pair<const Result*, const Result*> same[] = {
      {&memory, &disk_after}, {&memory_ib, &disk}, {&memory, o.clip > 0 ? &memory : &memory_ib}};
  for (const auto& [a, b] : same) {
    for (size_t i = 0; i < a->losses.size(); ++i) {
      if (i >= b->losses.size() || std::abs(b->losses[i] - a->losses[i]) > 1e-6) {
        std::fprintf(stderr, "bench_disk_tier: the modes' losses differ at step %zu: not the same work\n", i);
        return 1;
      }
    }
  }
  const int64_t n = disk.measured > 0 ? disk.measured : 1;
  const int64_t n_after = disk_after.measured > 0 ? disk_after.measured : 1;
  const double mine[] = {median(memory.step_s),
                         median(disk.step_s),
                         double(disk.io.disk_read) / n,
                         double(disk.io.disk_write) / n,
                         double(disk.state_bytes),
                         double(disk.plan.per_step.disk_read),
                         double(disk.plan.per_step.disk_write),
                         median(memory_ib.step_s),
                         median(disk_after.step_s),
                         double(disk_after.io.disk_read + disk_after.io.disk_write) / n_after};
  constexpr int kFields = 10;
  const int world = dist->world_size();
  auto all = at::zeros({world * kFields}, at::kDouble);
  dist->world().all_gather(all, at::tensor(at::ArrayRef<double>(mine, kFields), at::kDouble), "report").wait();
  if (dist->rank() == 0) {
    nlohmann::json out;
    out["world_size"] = world;
    out["model"] = {{"hidden", c.hidden_size},
                    {"intermediate", c.intermediate_size},
                    {"layers", c.num_hidden_layers},
                    {"vocab", c.vocab_size},
                    {"seq", o.seq},
                    {"batch", o.batch}};
    out["steps_per_round"] = o.steps;
    out["clip_after_backward"] = o.clip;
    out["rounds"] = o.rounds;
    out["budget_bytes"] = o.budget;
    for (int r = 0; r < world; ++r) {
      auto v = all.narrow(0, kFields * r, kFields);
      const double moved = v[2].item<double>() + v[3].item<double>();
      const double memory_best = std::min(v[0].item<double>(), v[7].item<double>());
      out["ranks"].push_back(
          {{"memory_step_s", v[0].item<double>()},
           {"memory_in_backward_step_s", v[7].item<double>()},
           {"disk_after_backward_step_s", v[8].item<double>()},
           {"disk_step_s", v[1].item<double>()},
           {"ratio", v[1].item<double>() / memory_best},
           {"ratio_after_backward", v[8].item<double>() / v[0].item<double>()},
           {"moved_after_backward_over_state_read_and_written", v[9].item<double>() / (2 * v[4].item<double>())},
           {"disk_read_per_step", v[2].item<double>()},
           {"disk_write_per_step", v[3].item<double>()},
           {"state_bytes", v[4].item<double>()},
           {"moved_over_state_read_and_written", moved / (2 * v[4].item<double>())},
           {"planned_read_per_step", v[5].item<double>()},
           {"planned_write_per_step", v[6].item<double>()},
           {"moved_over_plan", moved / (v[5].item<double>() + v[6].item<double>())}});
    }
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}
