// fsdp-train's main (hooks.h): the command line, the config, the data, then the job.
//
// Exit status: 0 on success, 2 for a usage or config error (reported before joining the job when
// it can be), 1 for any other failure, 128 + S after signal S, SIGTERM or SIGINT (preemption.h:
// every rank stops after the step in flight and saves a checkpoint with --save-dir). Errors go to
// stderr as "fsdp-train: error: <what>", and under torchrun in its error file (TORCHELASTIC_ERROR_FILE).
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>

#include <sched.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "base/strings.h"
#include "config.h"
#include "data.h"
#include "flags.h"
#include "fsdp/errors.h"
#include "fsdp/launcher_error.h"
#include "hooks.h"
#include "init_from.h"
#include "preemption.h"
#include "run_plan.h"
#include "trainer.h"

namespace train {
namespace {

int print_plan(const RunPlan& run) {
  if (!run.plan) throw std::invalid_argument(run.refused);
  std::printf("plan per rank for this config (fsdp-train --plan):\n%s", run.plan->to_string().c_str());
  return run.plan->fits ? 0 : 2;
}

// Half-precision compute on a CPU without bf16 / fp16 matrix instructions (AVX512-BF16, AMX, AVX512-FP16):
// LibTorch's products of that dtype take a slow path there (measured at 100-400x float32's time on
// an AVX2 CPU, docs/NOTES.md), which a user should hear of before the first step, not after.
std::string slow_half_note(const TrainConfig& config) {
  const at::ScalarType t = config.fsdp.param_dtype;
  if (config.fsdp.device != "cpu" || (t != at::kBFloat16 && t != at::kHalf)) return "";
  const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* key) {
    const auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  const bool native =
      t == at::kBFloat16 ? has("avx512_bf16") || has("amx_bf16") : has("avx512_fp16") || has("amx_fp16");
  if (native) return "";
  const std::string name = t == at::kBFloat16 ? "bfloat16" : "float16";
  return "note: fsdp.param_dtype=" + name + " on a CPU without " + name + " matrix instructions: LibTorch's " + name +
         " products take a slow path here (100-400x float32's time on an AVX2 CPU); "
         "fsdp.param_dtype=float32 computes faster at twice the gathered bytes";
}

// Before the job joins and before anything is allocated: a run that cannot fit is refused on every
// rank. A run that goes on prints its plan first (rank 0) and leaves it where a launcher looks
// after a rank that died without a word (FSDP_RUN_PLAN_FILE, set by fsdp-run).
void check_plan(const TrainConfig& config, const RunPlan& run) {
  check_budget(config, run);
  if (!run.plan) return;  // unchecked, and the planner refused the config: no plan to print
  const std::string summary = plan_summary(run);
  const char* rank = std::getenv("RANK");
  if (rank == nullptr || std::string(rank) == "0") {
    std::printf("%s\n", summary.c_str());
    if (const std::string note = slow_half_note(config); !note.empty()) std::printf("%s\n", note.c_str());
  }
  if (const char* file = std::getenv("FSDP_RUN_PLAN_FILE"); file != nullptr && *file != '\0') {
    if (std::FILE* f = std::fopen(file, "w")) {
      std::fprintf(f, "%s\n", summary.c_str());
      std::fclose(f);
    }
  }
}

// Every rank reports, on stderr and in torchrun's error file (its summary then names the cause):
// a launcher may stop rank 0 before it prints when another rank exits first.
int report_error(const std::exception& e, int status) {
  std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
  fsdp::write_launcher_error(e);
  return status;
}

}  // namespace

int main_with_hooks(int argc, char** argv, const TrainHooks& hooks) {
  Flags flags;
  TrainConfig config;
  std::optional<Dataset> data;
  RunPlan run;
  // Every line goes out as it is written, also into a launcher's pipe: a rank killed from outside
  // (the OOM killer) has printed all it got to.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
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
    if (!flags.init_only || flags.plan) {  // --init-only measures the process before any model or plan
      run = plan_run(config,
                     !flags.resume.empty()      ? fsdp::LoadKind::kResume
                     : !flags.init_from.empty() ? fsdp::LoadKind::kImport
                                                : fsdp::LoadKind::kInit,
                     !flags.save_dir.empty(),
                     !flags.init_from.empty() && config.lora.base_in_place && bnb_4bit_source(flags.init_from));
    }
    if (flags.plan) return print_plan(run);
    if (!flags.init_only) check_plan(config, run);
    // Note [fsdp-train's threads] (flags.cpp): ranks on one machine share its cores.
    cpu_set_t set;
    CPU_ZERO(&set);
    const int cores = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    at::set_num_threads(intra_op_threads(std::getenv("FSDP_THREADS"), std::getenv("OMP_NUM_THREADS"),
                                         std::getenv("LOCAL_WORLD_SIZE"), cores));
  } catch (const std::exception& e) {
    return report_error(e, 2);
  }
  try {
    // Before the job joins: a SIGTERM during start-up stops it after its first step.
    install_stop_handlers();
    hooks.check();  // a bad test setting fails now, not at the stop
    return run_training(config, flags, run, std::move(*data), hooks);
  } catch (const std::invalid_argument& e) {
    return report_error(e, 2);
  } catch (const fsdp::ConfigError& e) {
    return report_error(e, 2);
  } catch (const std::exception& e) {
    return report_error(e, 1);
  }
}

}  // namespace train
