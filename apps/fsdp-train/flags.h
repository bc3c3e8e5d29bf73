// fsdp-train's command line. Parsing is separate from the config so that a usage error (unknown
// flag, missing value) is reported before anything else and exits with status 2.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "config.h"

namespace train {

// A bad command line or config: the trainer prints it and exits with status 2.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct Flags {
  std::string config_path;  // --config FILE
  // Config overrides in command-line order: --set k=v, and --steps / --seed / --data, which are
  // shorthands for train.steps, train.seed and data.{source, path}. Applied after the file.
  std::vector<std::pair<std::string, std::string>> overrides;
  std::string save_dir;    // --save-dir DIR
  std::string resume;      // --resume latest|DIR
  std::string metrics;     // --metrics FILE
  std::string trace;       // --trace FILE
  std::string init_from;   // --init-from HF_DIR: model and weights from a Hugging Face directory
  bool init_only = false;  // --init-only: join the job, report peak RSS, build no model
  bool plan = false;       // --plan: print the run's plan (fsdp/plan.h) and exit, joining nothing
  // --allow-schedule-change: a --resume whose lr at the resumed step differs from the saved run's
  // (resume_review.h, Note [Resume changes]) goes ahead instead of being refused.
  bool allow_schedule_change = false;
  bool help = false;
};

// Parses argv[1..]; throws UsageError naming the offending flag. Accepts "--flag value" and
// "--flag=value".
Flags parse_flags(int argc, const char* const* argv);

// Note [fsdp-train's threads]: the intra-op threads of each rank, from FSDP_THREADS (a positive
// integer, else UsageError), else OMP_NUM_THREADS (its first number, as fsdp-run and torchrun set
// it; ignored when it is none), else the rank's share of `cores`: cores / LOCAL_WORLD_SIZE, at
// least 1. Null where a variable is unset.
int intra_op_threads(const char* fsdp_threads, const char* omp_num_threads, const char* local_world_size, int cores);

// The effective config for `flags`: defaults, --config file, then the overrides. Throws
// std::invalid_argument (config errors name the dotted key).
TrainConfig config_from_flags(const Flags& flags);

const char* usage_text();
// --help: usage_text(), then every config key with its default and help (config_fields.h).
std::string help_text();

}  // namespace train
