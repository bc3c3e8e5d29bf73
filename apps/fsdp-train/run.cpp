// fsdp-train's main (hooks.h): the command line, the config, the data, then the job.
//
// Exit status: 0 on success, 2 for a usage or config error (reported before joining the job when
// it can be), 1 for any other failure, 128 + S after signal S, SIGTERM or SIGINT (preemption.h:
// every rank stops after the step in flight and saves a checkpoint with --save-dir). Errors go to
// stderr as "fsdp-train: error: <what>".
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "config.h"
#include "data.h"
#include "flags.h"
#include "fsdp/errors.h"
#include "hooks.h"
#include "memory_plan.h"
#include "preemption.h"
#include "trainer.h"

namespace train {
namespace {

int print_plan(const TrainConfig& config) {
  const fsdp::Plan plan = plan_run(config);
  std::printf("plan per rank for this config (fsdp-train --plan):\n%s", plan.to_string().c_str());
  return plan.fits ? 0 : 2;
}

// Before the job joins and before anything is allocated: a run that cannot fit is refused on every rank.
void check_plan(const TrainConfig& config) {
  const fsdp::Plan plan = plan_run(config);
  if (plan.fits) return;
  throw std::invalid_argument("the run does not fit this machine's budgets (train.budget): " + plan.shortfall +
                              " fsdp-train --plan prints the whole plan; train.budget.check=false runs it anyway.");
}

}  // namespace

int main_with_hooks(int argc, char** argv, const TrainHooks& hooks) {
  Flags flags;
  TrainConfig config;
  std::optional<Dataset> data;
  try {
    flags = parse_flags(argc, argv);
    if (flags.help) {
      std::fputs(help_text().c_str(), stdout);
      return 0;
    }
    config = config_from_flags(flags);
    // Opened and validated before joining the job: a bad data file fails at once, not after the
    // rendezvous.
    data.emplace(config.data, config.model.vocab_size, config.train.seed);
    if (flags.plan) return print_plan(config);
    if (config.train.check_budget && !flags.init_only) check_plan(config);
  } catch (const std::exception& e) {
    // Every rank reports: a launcher may stop rank 0 before it prints when another rank exits first.
    std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 2;
  }
  int threads = 1;
  if (const char* env = std::getenv("FSDP_THREADS")) {
    threads = std::atoi(env);
    if (threads < 1) {
      std::fprintf(stderr, "fsdp-train: error: FSDP_THREADS=%s must be a positive integer\n", env);
      return 2;
    }
  }
  // One intra-op thread per rank by default: ranks on one machine would otherwise oversubscribe it.
  at::set_num_threads(threads);
  try {
    // Before the job joins: a SIGTERM during start-up stops it after its first step.
    install_stop_handlers();
    hooks.check();  // a bad test setting fails now, not at the stop
    return run_training(config, flags, std::move(*data), hooks);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 2;
  } catch (const fsdp::ConfigError& e) {
    std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace train
