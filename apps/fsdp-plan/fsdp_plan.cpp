// fsdp-plan: what a run needs per rank, tier by tier, and the choices that make it fit, printed
// before anything is built or allocated (the library's planner, fsdp/plan.h).
//
//   fsdp-plan --hf-config DIR|config.json --nproc-per-node 8 --device cuda --device-memory 24GB
//   fsdp-plan --config train.json [--set KEY=VALUE]... [--nproc-per-node 2]   # fsdp-train's run
//
// Exit status: 0 when the run fits, 1 when it does not (the printout says what is short, by how
// many bytes, and which lever would fix it), 2 for a usage or config error.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "base/file_io.h"
#include "base/strings.h"
#include "config.h"
#include "hf.h"
#include "init_from.h"
#include "run_plan.h"
#include "shape.h"

namespace {

const char* kUsage =
    "usage: fsdp-plan (--hf-config DIR|FILE | --config FILE) [--set KEY=VALUE]...\n"
    "                 [--nproc-per-node N] [--nnodes M] [--device cpu|cuda] [--device-memory SIZE]\n"
    "                 [--host-memory SIZE] [--disk SIZE] [--seq-len T] [--batch B] [--dtype D] [--choose]\n"
    "                 [--margin PCT] [--load init|import|resume] [--save yes|no]\n"
    "\n"
    "Prints, per rank, the bytes each tier holds (device, host, disk), the bytes the collectives and\n"
    "the disk tier move per step, the assumptions, and whether the run fits the budgets.\n"
    "\n"
    "  --hf-config X       a Hugging Face config.json (or its directory): choices are made for it\n"
    "  --config FILE       an fsdp-train config: its choices (offload, checkpointing, micro-batch,\n"
    "                      strategy) are kept, as fsdp-train --plan does, unless --choose\n"
    "  --set KEY=VALUE     override an fsdp-train config key, e.g. lora.r=16, lora.base_dtype=nf4; a\n"
    "                      choice it names (fsdp.strategy, fsdp.offload.*, train.activation_checkpointing,\n"
    "                      data.batch_size_per_rank, train.grad_accum_steps, train.async_save) is kept,\n"
    "                      the planner makes the others; a key no figure depends on is noted\n"
    "  --nproc-per-node N  ranks per node (1)          --nnodes M  nodes (1)\n"
    "  --device D          cpu (1 rank's memory is the host's) or cuda (a prediction only)\n"
    "  --device-memory S   per rank, e.g. 24GB or 80GiB (needed with cuda); a size needs a unit (B for\n"
    "                      bytes, KB MB GB TB, KiB MiB GiB TiB)\n"
    "  --host-memory S     per rank (default: this machine's MemAvailable / ranks per node)\n"
    "  --disk S            per rank, for the disk tier (default: free space here / ranks per node)\n"
    "  --seq-len T         tokens per sample (--hf-config: 2048)\n"
    "  --batch B           samples per rank per step (--hf-config: 1); the micro-batch is chosen\n"
    "  --dtype D           compute dtype, bfloat16 / float16 / float32 (--hf-config: bfloat16)\n"
    "  --choose            with --config: let the planner choose offload, checkpointing and micro-batch\n"
    "  --margin PCT        of the device's memory (on cpu the host's) held free when choosing, for what\n"
    "                      the plan does not count (the allocator's slack, the data pipeline): 10% unless given\n"
    "  --load L            how the model gets its values, planned as a phase of its own: init, import\n"
    "                      (foreign weights; --hf-config's default) or resume (--config's: init)\n"
    "  --save yes|no       whether the run saves checkpoints, a phase of its own (yes)\n";

struct Args {
  std::string hf, config;
  std::vector<std::pair<std::string, std::string>> sets;
  int ranks_per_node = 1, nodes = 1;
  std::string device = "cpu", dtype;
  int64_t device_memory = 0, host_memory = 0, disk = 0, seq_len = 0, batch = 0;
  double margin = fsdp::kDefaultMargin;
  bool choose = false;
  std::string load;  // empty: import with --hf-config, init with --config
  bool save = true;
};

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// "24GB", "80GiB", "512MB", "1.5TB", "4096B"; decimal units are 1000-based, "i" units 1024-based. A
// bare number is refused: "--device-memory 24" meant 24 GB, not 24 bytes.
int64_t parse_size(const std::string& flag, const std::string& v) {
  size_t end = 0;
  double n = 0;
  try {
    n = std::stod(v, &end);
  } catch (const std::exception&) {
    throw UsageError(flag + " " + v + ": not a size (e.g. 24GB, 80GiB, 4096B)");
  }
  std::string unit = v.substr(end);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.empty()) {
    throw UsageError(flag + " " + v + ": a size needs a unit: " + v + "GB, " + v + "GiB, or " + v + "B for bytes");
  }
  const std::pair<const char*, double> units[] = {{"B", 1},
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
    if (unit != name) continue;
    const double bytes = n * scale;
    if (!(bytes >= 1)) throw UsageError(flag + " " + v + ": not a positive size (e.g. 24GB, 80GiB, 4096B)");
    // 2^60 bytes (an exbibyte) per rank: beyond any machine, and the plan's sums stay inside 64 bits.
    if (bytes > 1152921504606846976.0) throw UsageError(flag + " " + v + ": out of range (at most 1 EiB per rank)");
    return static_cast<int64_t>(bytes);
  }
  throw UsageError(flag + " " + v + ": unknown unit \"" + v.substr(end) + "\" (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

// "10%" (or "10"): a percentage in [0, 90].
double parse_margin(const std::string& flag, const std::string& v) {
  size_t end = 0;
  double pct = -1;
  try {
    pct = std::stod(v, &end);
  } catch (const std::exception&) {
  }
  const std::string rest = end < v.size() ? v.substr(end) : "";
  if (!(rest.empty() || rest == "%") || !(pct >= 0 && pct <= 90)) {
    throw UsageError(flag + " " + v + ": a percentage of the device's memory from 0% to 90%, e.g. 10%");
  }
  return pct / 100;
}

int parse_count(const std::string& flag, const std::string& v) {
  try {
    size_t end = 0;
    const int n = std::stoi(v, &end);
    if (n >= 1 && end == v.size()) return n;
  } catch (const std::exception&) {
  }
  throw UsageError(flag + " " + v + ": must be a positive integer (at most 2147483647)");
}

bool parse_yes_no(const std::string& flag, const std::string& v) {
  if (v != "yes" && v != "no") throw UsageError(flag + " " + v + ": yes or no");
  return v == "yes";
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
    else if (f == "--margin") a.margin = parse_margin(f, v);
    else if (f == "--load") a.load = v;
    else if (f == "--save") a.save = parse_yes_no(f, v);
    else throw UsageError("unknown flag " + f);
  }
  if (a.hf.empty() == a.config.empty()) throw UsageError("give one of --hf-config and --config");
  if (a.device != "cpu" && a.device != "cuda") throw UsageError("--device " + a.device + ": cpu or cuda");
  if (a.device == "cuda" && a.device_memory == 0) throw UsageError("--device cuda needs --device-memory");
  // A --set that a flag would silently overwrite is refused: the flag is the one way to say it.
  // (--device always has a value, so fsdp.device is always refused.)
  struct Owned {
    const char* key;
    const char* flag;
    bool given;
  };
  const Owned by_flag[] = {{"fsdp.device", "--device", true},
                           {"train.budget.host_bytes", "--host-memory", a.host_memory > 0},
                           {"train.budget.device_bytes", "--device-memory", a.device_memory > 0},
                           {"train.budget.disk_bytes", "--disk", a.disk > 0}};
  for (const auto& [key, value] : a.sets) {
    for (const auto& o : by_flag) {
      if (key == o.key && o.given)
        throw UsageError("--set " + key + "=" + value + ": give it as " + o.flag + " instead");
    }
    if (key == "data.seq_len" && a.seq_len > 0) throw UsageError("--set data.seq_len and --seq-len: give one");
    if (key == "data.batch_size_per_rank" && a.batch > 0) {
      throw UsageError(
          "--set data.batch_size_per_rank and --batch: give one (--batch lets the planner choose the "
          "micro-batch; the --set fixes it)");
    }
    if (key == "fsdp.param_dtype" && !a.dtype.empty()) throw UsageError("--set fsdp.param_dtype and --dtype: give one");
  }
  return a;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Whether a --set names `key`.
bool user_set(const Args& a, const char* key) {
  return std::any_of(a.sets.begin(), a.sets.end(), [&](const auto& kv) { return kv.first == key; });
}

// The fsdp-train keys some figure of the plan depends on (train::plan_request and plan_shape read them).
bool plan_reads(const std::string& key) {
  for (const char* k : {"model.", "lora.", "fsdp.offload.", "train.budget."}) {
    if (starts_with(key, k) && key != "lora.adapter_from" && key != "lora.save_base" && key != "train.budget.check")
      return true;
  }
  for (const char* k :
       {"data.seq_len", "data.batch_size_per_rank", "fsdp.strategy", "fsdp.param_dtype", "fsdp.reduce_dtype",
        "fsdp.prefetch_depth", "fsdp.device", "train.grad_accum_steps", "train.activation_checkpointing",
        "train.loss_chunk_tokens", "train.async_save", "train.save_in_step", "optim.state_dtype", "train.accumulation",
        "train.keep_gathered", "fsdp.reshard_after_forward_group", "fsdp.split_root", "fsdp.vocab_parallel"}) {
    if (key == k) return true;
  }
  return false;
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
  for (const auto& [key, value] : a.sets) {
    if (!plan_reads(key)) {
      std::fprintf(stderr, "fsdp-plan: note: --set %s=%s applies to the run, but no figure of its plan depends on it\n",
                   key.c_str(), value.c_str());
    }
  }
  if (a.host_memory > 0) cfg.train.budget_host_bytes = a.host_memory;
  if (a.device_memory > 0) cfg.train.budget_device_bytes = a.device_memory;
  if (a.disk > 0) cfg.train.budget_disk_bytes = a.disk;
  const train::Resolved choices = train::resolve(cfg, a.ranks_per_node, a.nodes);
  fsdp::PlanRequest req = train::plan_request(cfg, choices, a.ranks_per_node, a.nodes);
  req.margin = a.margin;
  req.load = fsdp::parse_load_kind(a.load.empty() ? (a.hf.empty() ? "init" : "import") : a.load);
  req.saves = a.save;
  req.nf4_codes_in_place = !a.hf.empty() && cfg.lora.base_in_place && train::bnb_4bit_source(a.hf);
  if (!a.hf.empty() || a.choose) {  // the planner chooses what no --set fixed
    const bool tiers = user_set(a, "fsdp.offload.params") || user_set(a, "fsdp.offload.grads") ||
                       user_set(a, "fsdp.offload.optimizer_state");
    if (!tiers && user_set(a, "fsdp.offload.memory_budget_bytes")) {
      throw std::invalid_argument(
          "--set fsdp.offload.memory_budget_bytes: the disk tier's window is kept only with the tiers it belongs "
          "to; --set fsdp.offload.params/grads/optimizer_state too, or leave the window to the planner");
    }
    if (!tiers) req.offload.reset();
    if (!user_set(a, "train.activation_checkpointing")) req.checkpoint_every.reset();
    if (!user_set(a, "train.keep_gathered")) req.keep_gathered.reset();
    if (!user_set(a, "data.batch_size_per_rank") && !user_set(a, "train.grad_accum_steps")) req.micro_batch.reset();
    if (!user_set(a, "fsdp.strategy")) req.strategy.reset();
    if (!user_set(a, "train.async_save")) req.async_save = false;
  }
  const fsdp::Plan plan = fsdp::plan(train::plan_shape(cfg, choices), req);
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
