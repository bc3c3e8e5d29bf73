// fsdp-plan: what a run needs per rank, tier by tier, and the choices that make it fit, printed
// before anything is built or allocated (the library's planner, fsdp/plan.h).
//
//   fsdp-plan --hf-config DIR|config.json --nproc-per-node 8 --device cuda --device-memory 24GB
//   fsdp-plan --config train.json [--set KEY=VALUE]... [--nproc-per-node 2]   # fsdp-train's run
//
// Exit status: 0 when the run fits, 1 when it does not (the printout says what is short, by how
// many bytes, and which lever would fix it), 2 for a usage or config error.
#include <cctype>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "base/file_io.h"
#include "base/strings.h"
#include "config.h"
#include "hf.h"
#include "memory_plan.h"
#include "shape.h"

namespace {

const char* kUsage =
    "usage: fsdp-plan (--hf-config DIR|FILE | --config FILE) [--set KEY=VALUE]...\n"
    "                 [--nproc-per-node N] [--nnodes M] [--device cpu|cuda] [--device-memory SIZE]\n"
    "                 [--host-memory SIZE] [--disk SIZE] [--seq-len T] [--batch B] [--dtype D] [--choose]\n"
    "\n"
    "Prints, per rank, the bytes each tier holds (device, host, disk), the bytes the collectives and\n"
    "the disk tier move per step, the assumptions, and whether the run fits the budgets.\n"
    "\n"
    "  --hf-config X       a Hugging Face config.json (or its directory): choices are made for it\n"
    "  --config FILE       an fsdp-train config: its choices (offload, checkpointing, micro-batch,\n"
    "                      strategy) are kept, as fsdp-train --plan does, unless --choose\n"
    "  --set KEY=VALUE     override an fsdp-train config key, e.g. lora.r=16, lora.base_dtype=nf4\n"
    "  --nproc-per-node N  ranks per node (1)          --nnodes M  nodes (1)\n"
    "  --device D          cpu (1 rank's memory is the host's) or cuda (a prediction only)\n"
    "  --device-memory S   per rank, e.g. 24GB or 80GiB (needed with cuda)\n"
    "  --host-memory S     per rank (default: this machine's MemAvailable / ranks per node)\n"
    "  --disk S            per rank, for the disk tier (default: free space here / ranks per node)\n"
    "  --seq-len T         tokens per sample (--hf-config: 2048)\n"
    "  --batch B           samples per rank per step (--hf-config: 1); the micro-batch is chosen\n"
    "  --dtype D           compute dtype, bfloat16 / float16 / float32 (--hf-config: bfloat16)\n"
    "  --choose            with --config: let the planner choose offload, checkpointing and micro-batch\n";

struct Args {
  std::string hf, config;
  std::vector<std::pair<std::string, std::string>> sets;
  int ranks_per_node = 1, nodes = 1;
  std::string device = "cpu", dtype;
  int64_t device_memory = 0, host_memory = 0, disk = 0, seq_len = 0, batch = 0;
  bool choose = false;
};

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// "24GB", "80GiB", "512MB", "1.5TB", or bytes; decimal units are 1000-based, "i" units 1024-based.
int64_t parse_size(const std::string& flag, const std::string& v) {
  size_t end = 0;
  double n = 0;
  try {
    n = std::stod(v, &end);
  } catch (const std::exception&) {
    throw UsageError(flag + " " + v + ": not a size (e.g. 24GB, 80GiB, 4096)");
  }
  std::string unit = v.substr(end);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::pair<const char*, double> units[] = {{"", 1},
                                                  {"B", 1},
                                                  {"KB", 1e3},
                                                  {"MB", 1e6},
                                                  {"GB", 1e9},
                                                  {"TB", 1e12},
                                                  {"K", 1024.0},
                                                  {"KIB", 1024.0},
                                                  {"M", 1 << 20},
                                                  {"MIB", 1 << 20},
                                                  {"G", 1 << 30},
                                                  {"GIB", 1 << 30},
                                                  {"T", 1099511627776.0},
                                                  {"TIB", 1099511627776.0}};
  for (const auto& [name, scale] : units) {
    if (unit == name && n > 0) return static_cast<int64_t>(n * scale);
  }
  throw UsageError(flag + " " + v + ": not a positive size (e.g. 24GB, 80GiB, 4096)");
}

int parse_count(const std::string& flag, const std::string& v) {
  try {
    const int n = std::stoi(v);
    if (n >= 1) return n;
  } catch (const std::exception&) {
  }
  throw UsageError(flag + " " + v + ": must be a positive integer");
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") throw UsageError("");
    if (f == "--choose") {
      a.choose = true;
      continue;
    }
    if (i + 1 >= argc) throw UsageError("flag " + f + " needs a value");
    const std::string v = argv[++i];
    if (f == "--hf-config") a.hf = v;
    else if (f == "--config") a.config = v;
    else if (f == "--set") {
      const auto eq = v.find('=');
      if (eq == std::string::npos) throw UsageError("--set " + v + ": expected KEY=VALUE");
      a.sets.emplace_back(v.substr(0, eq), v.substr(eq + 1));
    } else if (f == "--nproc-per-node") a.ranks_per_node = parse_count(f, v);
    else if (f == "--nnodes") a.nodes = parse_count(f, v);
    else if (f == "--device") a.device = v;
    else if (f == "--device-memory") a.device_memory = parse_size(f, v);
    else if (f == "--host-memory") a.host_memory = parse_size(f, v);
    else if (f == "--disk") a.disk = parse_size(f, v);
    else if (f == "--seq-len") a.seq_len = parse_count(f, v);
    else if (f == "--batch") a.batch = parse_count(f, v);
    else if (f == "--dtype") a.dtype = v;
    else throw UsageError("unknown flag " + f);
  }
  if (a.hf.empty() == a.config.empty()) throw UsageError("give one of --hf-config and --config");
  if (a.device != "cpu" && a.device != "cuda") throw UsageError("--device " + a.device + ": cpu or cuda");
  if (a.device == "cuda" && a.device_memory == 0) throw UsageError("--device cuda needs --device-memory");
  return a;
}

// An fsdp-train config for the run: its own (--config), or the Hugging Face model's with the
// planner's defaults for what the config.json does not say.
train::TrainConfig run_config(const Args& a) {
  auto sets = a.sets;
  nlohmann::json doc = a.config.empty() ? nlohmann::json::object() : train::read_config_file(a.config);
  if (!a.hf.empty()) {
    const std::string file = fsdp::io::is_dir(a.hf) ? fsdp::io::join(a.hf, "config.json") : a.hf;
    const llama::LlamaConfig m = llama::hf::config_from_hf_json(fsdp::io::read_small_file(file), file);
    doc["model"] = m.to_json();
    sets.insert(sets.begin(), {{"data.seq_len", "2048"},
                               {"data.batch_size_per_rank", "1"},
                               {"fsdp.param_dtype", "bfloat16"},
                               {"fsdp.reduce_dtype", "float32"}});
  }
  sets.emplace_back("fsdp.device", a.device);
  if (a.seq_len > 0) sets.emplace_back("data.seq_len", std::to_string(a.seq_len));
  if (a.batch > 0) sets.emplace_back("data.batch_size_per_rank", std::to_string(a.batch));
  if (!a.dtype.empty()) sets.emplace_back("fsdp.param_dtype", a.dtype);
  return train::build_config(doc, sets);
}

int run(const Args& a) {
  train::TrainConfig cfg = run_config(a);
  cfg.train.budget_host_bytes = a.host_memory;
  cfg.train.budget_device_bytes = a.device_memory;
  cfg.train.budget_disk_bytes = a.disk;
  fsdp::PlanRequest req = train::plan_request(cfg, a.ranks_per_node, a.nodes);
  if (!a.hf.empty() || a.choose) {
    req.offload.reset();
    req.checkpoint_every.reset();
    req.micro_batch.reset();
    req.strategy.reset();
    req.async_save = false;
  }
  const fsdp::Plan plan = fsdp::plan(train::plan_shape(cfg), req);
  const auto& m = cfg.model;
  std::printf(
      "model: %s, %lld layers, hidden %lld, vocab %lld: %.3fB params; %d node(s) x %d rank(s) on %s; "
      "seq_len %lld, %lld sample(s) per rank per step; compute %s\n",
      m.model_type.c_str(), static_cast<long long>(m.num_hidden_layers), static_cast<long long>(m.hidden_size),
      static_cast<long long>(m.vocab_size), static_cast<double>(llama::param_counts(m).total(m)) / 1e9, a.nodes,
      a.ranks_per_node, a.device.c_str(), static_cast<long long>(cfg.data.seq_len),
      static_cast<long long>(req.batch_per_rank), train::dtype_name(cfg.fsdp.param_dtype));
  std::printf("budgets per rank: device %s, host %s, disk %s\n",
              a.device == "cpu" ? "(the host)" : fsdp::base::mib(req.budget.device_bytes, 0).c_str(),
              fsdp::base::mib(req.budget.host_bytes, 0).c_str(), fsdp::base::mib(req.budget.disk_bytes, 0).c_str());
  std::printf("%s", plan.to_string().c_str());
  return plan.fits ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const UsageError& e) {
    if (*e.what() != '\0') std::fprintf(stderr, "fsdp-plan: error: %s\n", e.what());
    std::fputs(kUsage, *e.what() == '\0' ? stdout : stderr);
    return *e.what() == '\0' ? 0 : 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-plan: error: %s\n", e.what());
    return 2;
  }
}
