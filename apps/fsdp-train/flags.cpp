// Command-line parsing for fsdp-train: every flag is recognised and its value checked in one place.
#include "flags.h"

#include "config_fields.h"
#include "init_from.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

namespace train {
namespace {

// A non-negative decimal integer, whole string.
bool parse_count(const std::string& s, uint64_t& out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtoull(s.c_str(), &end, 10);
  return errno == 0 && *end == '\0';
}

// The flags that take a value ("--flag value" or "--flag=value").
bool takes_value(const std::string& flag) {
  for (const char* f : {"--config", "--set", "--steps", "--seed", "--data", "--save-dir", "--resume", "--metrics",
                        "--trace", "--init-from"}) {
    if (flag == f) return true;
  }
  return false;
}

// Records one flag that takes a value.
void apply_flag(Flags& f, const std::string& arg, const std::string& v) {
  if (arg == "--set") {
    const size_t eq = v.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw UsageError("flag --set expects KEY=VALUE (e.g. optim.lr=1e-3), got '" + v + "'");
    }
    f.overrides.emplace_back(v.substr(0, eq), v.substr(eq + 1));
  } else if (arg == "--steps" || arg == "--seed") {
    uint64_t n = 0;
    if (!parse_count(v, n)) throw UsageError("flag " + arg + " expects a non-negative integer, got '" + v + "'");
    f.overrides.emplace_back(arg == "--steps" ? "train.steps" : "train.seed", v);
  } else if (arg == "--data") {
    if (v.empty()) throw UsageError("flag --data needs a file name");
    f.overrides.emplace_back("data.source", "file");
    // Quoted so that a file named e.g. "123" is still taken as a path.
    // replace: a path that is not UTF-8 then fails to open, naming it, instead of throwing here.
    f.overrides.emplace_back("data.path",
                             nlohmann::json(v).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {  // --config, --save-dir, --resume, --metrics, --init-from, --trace: a value that is not empty
    static const std::map<std::string, std::pair<std::string Flags::*, const char*>> kValues = {
        {"--config", {&Flags::config_path, "a file name"}},
        {"--save-dir", {&Flags::save_dir, "a directory"}},
        {"--resume", {&Flags::resume, "'latest' or a checkpoint directory"}},
        {"--metrics", {&Flags::metrics, "a file name"}},
        {"--init-from", {&Flags::init_from, "a Hugging Face model directory"}},
        {"--trace", {&Flags::trace, "a file name"}}};
    const auto& [field, what] = kValues.at(arg);
    if (v.empty()) throw UsageError("flag " + arg + " needs " + what);
    f.*field = v;
  }
}

}  // namespace

const char* usage_text() {
  return "usage: fsdp-train [--config FILE] [--set KEY=VALUE]... [--steps N] [--seed N] [--data FILE]\n"
         "                  [--save-dir DIR] [--resume latest|DIR] [--metrics FILE] [--trace FILE] [--init-only]\n"
         "                  [--init-from HF_DIR] [--allow-schedule-change] [--plan]\n"
         "                  [--help]\n"
         "\n"
         "Trains a Llama-style decoder with fully-sharded data parallelism. Launch one process per rank,\n"
         "e.g. fsdp-run --nproc-per-node 2 -- fsdp-train; without a launcher it runs as one process.\n"
         "\n"
         "  --config FILE       JSON config: sections model, data, optim, fsdp, train (every key optional)\n"
         "  --set KEY=VALUE     override one config key, e.g. --set optim.lr=1e-3 (repeatable; VALUE is\n"
         "                      parsed as JSON when it parses, as a string otherwise)\n"
         "  --steps N           total optimizer steps to reach (train.steps); a run resumed at step N stops\n"
         "  --seed N            parameter init and data order (train.seed)\n"
         "  --data FILE         train on FILE: .bin = uint16 tokens (nanoGPT / llm.c), else raw bytes\n"
         "  --save-dir DIR      save checkpoints into DIR (every train.save_every steps and at the end)\n"
         "  --resume WHICH      'latest' (the newest in --save-dir; none yet: start at step 0) or a\n"
         "                      checkpoint directory; a change of train.steps, the lr schedule or the\n"
         "                      global batch against the saved run is printed with its effect\n"
         "  --allow-schedule-change\n"
         "                      accept a --resume whose lr at the resumed step differs from what the saved\n"
         "                      run's schedule gives there (refused otherwise, before anything is loaded)\n"
         "  --metrics FILE      JSON lines, one per step and one per evaluation (written by rank 0)\n"
         "  --trace FILE        Chrome trace (Perfetto, chrome://tracing) of the step phases and of fsdp's\n"
         "                      gathers, reductions and waits; with several ranks each writes FILE with\n"
         "                      .rankK before the extension\n"
         "  --init-only         join the job and exit without building the model: each rank's peak RSS\n"
         "                      (printed, and one --metrics line {\"init_only\": true, \"peak_rss_bytes\"})\n"
         "                      is the process's baseline that memory figures are measured against\n"
         "  --init-from HF_DIR  start from a Hugging Face model directory (llama, qwen2, qwen3, mistral):\n"
         "                      config.json gives the model section, model.safetensors (or its index)\n"
         "                      the weights, read by each rank into its own shards; with --resume the\n"
         "                      checkpoint's weights win. A larger model.vocab_size grows the embedding\n"
         "                      and LM head: new rows are the mean of the pretrained ones\n"
         "  --plan              print the run's plan and exit: per rank, the bytes in each tier, what\n"
         "                      each step sends and reads, the assumptions, and whether it fits\n"
         "                      train.budget (ranks from WORLD_SIZE / LOCAL_WORLD_SIZE, else 1); exit 0\n"
         "                      when it fits, 2 when it does not. Without --plan a run that does not fit\n"
         "                      is refused before anything is allocated (train.budget.check)\n"
         "  --help              this text\n"
         "\n"
         "SIGTERM or SIGINT: every rank stops after the step in flight, saves to --save-dir and exits with\n"
         "128 + signal; a second signal exits at once, keeping the previous checkpoint.\n"
         "Environment: FSDP_THREADS (intra-op threads per rank; default OMP_NUM_THREADS, which fsdp-run\n"
         "sets to the rank's share of the cores, else cores / LOCAL_WORLD_SIZE).\n";
}

// Note [fsdp-train's threads]
// fsdp-train took one intra-op thread unless FSDP_THREADS said otherwise, and ignored
// OMP_NUM_THREADS: launched by fsdp-run with one rank on a 2-core machine (fsdp-run sets the
// rank's share, 2) it computed on one core, at 2.1x the step time of transformers + peft on the
// same work (bench/vs_peft.py's fsdp1-bf16). FSDP_THREADS still wins; then OMP_NUM_THREADS, as
// LibTorch itself would read it; then the rank's share of the cores it may run on.
int intra_op_threads(const char* fsdp_threads, const char* omp_num_threads, const char* local_world_size, int cores) {
  if (fsdp_threads != nullptr) {
    const int n = std::atoi(fsdp_threads);
    if (n < 1) throw UsageError(std::string("FSDP_THREADS=") + fsdp_threads + " must be a positive integer");
    return n;
  }
  if (omp_num_threads != nullptr && std::atoi(omp_num_threads) >= 1) return std::atoi(omp_num_threads);
  const int ranks = local_world_size != nullptr ? std::max(1, std::atoi(local_world_size)) : 1;
  return std::max(1, cores / ranks);
}

std::string help_text() { return std::string(usage_text()) + "\n" + config_help(); }

Flags parse_flags(int argc, const char* const* argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (arg.rfind("--", 0) == 0) {
      const size_t eq = arg.find('=');
      if (eq != std::string::npos) {
        inline_value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
    }
    if (arg == "--help" || arg == "-h") {
      if (inline_value) throw UsageError("flag --help takes no value");
      f.help = true;
    } else if (arg == "--plan") {
      f.plan = true;
    } else if (arg == "--init-only" || arg == "--allow-schedule-change") {
      if (inline_value) throw UsageError("flag " + arg + " takes no value");
      (arg == "--init-only" ? f.init_only : f.allow_schedule_change) = true;
    } else if (takes_value(arg)) {
      if (!inline_value && i + 1 >= argc) throw UsageError("flag " + arg + " needs a value");
      apply_flag(f, arg, inline_value ? *inline_value : std::string(argv[++i]));
    } else if (arg.rfind("-", 0) == 0) {
      throw UsageError("unknown flag " + arg + " (see --help)");
    } else {
      throw UsageError("unexpected argument '" + arg + "' (see --help)");
    }
  }
  if (f.resume == "latest" && f.save_dir.empty()) {
    throw UsageError("--resume latest needs --save-dir (the directory holding the checkpoints)");
  }
  return f;
}

TrainConfig config_from_flags(const Flags& flags) {
  nlohmann::json file_doc;
  if (!flags.config_path.empty()) file_doc = read_config_file(flags.config_path);
  if (flags.init_from.empty()) return build_config(file_doc, flags.overrides);
  file_doc = with_hf_model(flags.init_from, file_doc, flags.overrides);
  TrainConfig config = build_config(file_doc, flags.overrides);
  check_hf_vocab(flags.init_from, config.model.vocab_size);
  return config;
}

}  // namespace train
