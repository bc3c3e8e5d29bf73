// Sharded checkpoint throughput and the training stall of a background save. One process per
// rank (fsdp-run). The model is a stack of square weight matrices (--mib MiB of fp32 params in
// all, --layers of them), initialised on the meta device so no rank ever holds all of it, with
// AdamW state present (one step taken). Phases, each bracketed by barriers:
//   save   fsdp::checkpoint::save of params + exp_avg + exp_avg_sq; bytes = every file's size;
//          the best of --repeats runs (the disk may be shared), every run in the JSON
//   load   fsdp::checkpoint::load into a fresh model, best of --repeats (page cache dropped first
//          when we may; else the files are read from a warm cache, and the JSON says so)
//   async  the median of 5 plain steps, then one step that also calls AsyncSaver::save (which
//          returns after the snapshot): stall = that step - the plain step; and the time from the
//          call until the background save finished
// Data checked: the loaded shards and optimizer state must equal the saved ones bit for bit.
// Rank 0 prints one JSON object (all timings rank 0's, after barriers) to stdout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "shard/testing.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One square matrix: y = x W^T.
class SquareImpl : public torch::nn::Module {
 public:
  explicit SquareImpl(int64_t dim) {
    weight = register_parameter("weight", at::empty({dim, dim}, at::TensorOptions().device(at::kMeta)));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(Square);

class StackImpl : public torch::nn::Module {
 public:
  StackImpl(int64_t dim, int layers) {
    for (int i = 0; i < layers; ++i) blocks.push_back(register_module("layers_" + std::to_string(i), Square(dim)));
    bias = register_parameter("bias", at::empty({dim}, at::TensorOptions().device(at::kMeta)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = at::tanh(fsdp::call(b, x));
    return x + bias;
  }
  std::vector<Square> blocks;
  at::Tensor bias;
};
TORCH_MODULE(Stack);

struct Model {
  Stack stack{nullptr};
  std::shared_ptr<fsdp::FSDPModule> root;
  std::unique_ptr<fsdp::AdamW> optim;
};

Model make_model(fsdp::DeviceMesh& mesh, int64_t dim, int layers) {
  Model m;
  m.stack = Stack(dim, layers);
  auto opts = fsdp::FullyShardOptions().init(fsdp::init::normal(1.0 / std::sqrt(double(dim)), 17));
  for (auto& b : m.stack->blocks) fsdp::fully_shard(b, mesh, opts);
  m.root = fsdp::fully_shard(m.stack, mesh, opts);
  fsdp::testing::units(*m.root);  // lazy init: materialise this rank's shards now, not inside a timed phase
  m.optim = std::make_unique<fsdp::AdamW>(m.root, fsdp::AdamWOptions(1e-4));
  return m;
}

void train_step(Model& m, int64_t dim, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  auto x = at::randn({4, dim}, gen);
  fsdp::call(m.stack, x).pow(2).mean().backward();
  m.optim->step();
  m.optim->zero_grad();
}

// This rank's shards and optimizer state, in a fixed order (to check a load bit for bit).
std::vector<at::Tensor> local_state(Model& m) {
  std::vector<at::Tensor> parts;
  for (const auto& unit : fsdp::testing::units(*m.root)) {
    for (auto& fp : unit->flat_params()) parts.push_back(fp->sharded_param());
  }
  for (auto& s : m.optim->states()) {
    for (const auto& [name, t] : s.tensors) parts.push_back(t);
  }
  return parts;
}

bool same_state(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

int64_t dir_bytes(const std::string& dir) {
  int64_t total = 0;
  for (const auto& name : fsdp::io::list_dir(dir)) {
    struct stat st {};
    if (::stat(fsdp::io::join(dir, name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += st.st_size;
  }
  return total;
}

// Writes back dirty pages, then tries to drop the page cache (needs root and a writable /proc/sys).
bool drop_page_cache() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "3", 1) == 1;
  ::close(fd);
  return ok;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t mib = 512;
  int layers = 8;
  int repeats = 2;
  std::string dir = "/tmp/fsdp-bench-checkpoint";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc) mib = std::stoll(argv[++i]);
    else if (a == "--layers" && i + 1 < argc) layers = std::stoi(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc) repeats = std::stoi(argv[++i]);
    else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_checkpoint [--mib M] [--layers L] [--repeats R] [--dir DIR]\n");
      return 2;
    }
  }
  if (mib <= 0 || layers <= 0 || repeats <= 0) {
    std::fprintf(stderr, "bench_checkpoint: --mib, --layers and --repeats must be positive (got %lld, %d, %d)\n",
                 (long long)mib, layers, repeats);
    return 2;
  }
  at::set_num_threads(1);
  auto dist = fsdp::init_from_env();
  fsdp::DeviceMesh mesh(dist);
  auto& comm = dist->world();
  const bool lead = dist->rank() == 0;
  const int64_t dim = std::max<int64_t>(1, std::llround(std::sqrt(mib * double(1 << 20) / 4 / layers)));
  const int64_t params = layers * dim * dim + dim;
  if (lead) fsdp::io::remove_tree(dir), fsdp::io::make_dirs(dir);
  comm.barrier("start");

  nlohmann::json out;
  out["world_size"] = dist->world_size();
  out["layers"] = layers;
  out["dim"] = dim;
  out["params"] = params;
  out["param_bytes"] = params * 4;

  // ---- synchronous save, best of `repeats` (the disk is shared: single runs are noisy)
  std::vector<at::Tensor> saved_state;
  std::vector<double> save_runs;
  int64_t bytes = 0;
  {
    Model a = make_model(mesh, dim, layers);
    train_step(a, dim, 0);
    for (const auto& t : local_state(a)) saved_state.push_back(t.clone());
    fsdp::checkpoint::TrainState st;
    st.step = 1;
    {
      const auto t0 = Clock::now();
      dist->side_group("checkpoint");  // what the first save would create (one-time set-up, not I/O)
      comm.barrier("side_group");
      out["side_group_setup_seconds"] = seconds_since(t0);
    }
    for (int r = 0; r < repeats; ++r) {
      if (lead && r > 0) fsdp::io::remove_tree(fsdp::io::join(dir, "step-00000001"));
      if (lead) ::sync();  // no dirty pages left from before, as for dd in scripts/bench
      comm.barrier("save/before");
      const auto t0 = Clock::now();
      const std::string committed = fsdp::checkpoint::save(dir, "step-00000001", *a.root, a.optim.get(), st);
      comm.barrier("save/after");
      save_runs.push_back(seconds_since(t0));
      bytes = dir_bytes(committed);
    }
  }  // model a freed: the load below runs next to one model only
  const double save_s = *std::min_element(save_runs.begin(), save_runs.end());
  out["save"] = {{"seconds", save_s}, {"bytes", bytes}, {"gb_per_s", bytes / save_s / 1e9}, {"runs", save_runs}};

  // ---- load into a fresh model, best of `repeats`
  Model b = make_model(mesh, dim, layers);
  std::vector<double> load_runs;
  bool cold = true;
  for (int r = 0; r < repeats; ++r) {
    auto flag = at::full({1}, lead && drop_page_cache() ? 1.0 : 0.0, at::kDouble);
    comm.broadcast(flag, 0, "cache").wait();
    cold = cold && flag.item<double>() > 0;
    comm.barrier("load/before");
    const auto t0 = Clock::now();
    fsdp::checkpoint::load(fsdp::checkpoint::resolve(dir, "latest"), *b.root, b.optim.get());
    comm.barrier("load/after");
    load_runs.push_back(seconds_since(t0));
  }
  // Data check: every rank's shards and state equal what it saved, bit for bit.
  auto same = at::full({1}, same_state(local_state(b), saved_state) ? 0.0 : 1.0, at::kDouble);
  comm.all_reduce(same, fsdp::ReduceOp::kSum, "check").wait();
  const bool checked = same.item<double>() == 0;
  saved_state.clear();
  const double load_s = *std::min_element(load_runs.begin(), load_runs.end());
  out["load"] = {{"seconds", load_s},
                 {"bytes", bytes},
                 {"gb_per_s", bytes / load_s / 1e9},
                 {"runs", load_runs},
                 {"cache", cold ? "cold (dropped)" : "warm (could not drop the page cache)"},
                 {"data_checked", checked}};
  if (lead) fsdp::io::remove_tree(fsdp::io::join(dir, "step-00000001"));

  // ---- the stall of a background save
  std::vector<double> plain;
  for (int i = 0; i < 6; ++i) {
    comm.barrier("step/before");
    const auto t0 = Clock::now();
    train_step(b, dim, 1 + i);
    comm.barrier("step/after");
    if (i > 0) plain.push_back(seconds_since(t0));  // the first step after load warms up
  }
  {
    fsdp::checkpoint::AsyncSaver saver;
    fsdp::checkpoint::TrainState st;
    st.step = 8;
    comm.barrier("async/before");
    const auto t0 = Clock::now();
    train_step(b, dim, 7);
    const auto call = Clock::now();
    saver.save(dir, "step-00000008", *b.root, b.optim.get(), st);
    const double call_s = seconds_since(call);
    comm.barrier("async/after");
    const double step_s = seconds_since(t0);
    saver.wait();
    const double done_s = seconds_since(call);
    comm.barrier("async/done");
    const double plain_s = median(plain);
    out["async"] = {{"plain_step_seconds", plain_s},    {"plain_steps", plain},
                    {"step_with_save_seconds", step_s}, {"stall_seconds", step_s - plain_s},
                    {"save_call_seconds", call_s},      {"background_done_seconds", done_s}};
  }

  if (lead) {
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  comm.barrier("done");
  if (lead) fsdp::io::remove_tree(dir);
  if (!checked) {
    std::fprintf(stderr, "bench_checkpoint: rank %d: the loaded state differs from the saved one\n", dist->rank());
    return 1;
  }
  return 0;
}
