// fsdp-ckpt: inspect, verify, compare and export fsdp checkpoints (the directory format of
// include/fsdp/checkpoint.h) from the command line, with no process group and no model to shard.
//
//   fsdp-ckpt info DIR             tensors per file set, totals, the train state; last, the
//                                  process's peak RSS (reading headers only: the process alone)
//   fsdp-ckpt verify DIR           every check there is (Note [What verify checks]); "ok: ..."
//   fsdp-ckpt diff [opts] A B      equal training state? (Note [What diff compares])
//   fsdp-ckpt export [--dtype T] [--tokenizer-dir D] DIR OUT
//                                  a Hugging Face directory of the model's family, in dtype T
//                                  (Note [Hugging Face config]), with the tokenizer files
//                                  (Note [Tokenizer files]); last, the process's peak RSS
//   fsdp-ckpt logits DIR TOK OUT   logits of the unsharded model for int64 tokens (.npy in and out);
//                                  DIR may also be a Hugging Face model directory
//
// DIR is a checkpoint directory or a save root whose `latest` names one. Exit status: 0 success,
// 1 a failed verify, a difference or an error, 2 bad usage (and, for diff, an unreadable
// checkpoint, as diff(1) does).
#include <cstdio>
#include <exception>
#include <string>

#include "base/host_malloc.h"
#include "sysinfo/sysinfo.h"
#include "ckpt_commands.h"
#include "ckpt_view.h"
#include "fsdp/launcher_error.h"

namespace {

constexpr const char* kUsage =
    "usage: fsdp-ckpt COMMAND ARGS\n"
    "  info DIR                  tensors (name, dtype, shape, bytes) per file set, totals, train state\n"
    "  verify DIR                validate every file and read every byte; prints \"ok: N tensors, B bytes\"\n"
    "  diff [--ignore-world] [--ignore /json/pointer]... [--max-diffs N] A B\n"
    "                            exit 0 when A and B hold the same tensors (byte for byte) and train state\n"
    "                            (rng_states never compared; --ignore-world: nor world_size, strategy);\n"
    "                            shows the first N differences per file set and of train_state (default 20)\n"
    "  export [--dtype bfloat16|float16|float32] [--tokenizer-dir DIR] [--max-shard-size SIZE] DIR OUT\n"
    "                            write a Hugging Face directory of the model's family (LlamaForCausalLM,\n"
    "                            Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM: config.json and\n"
    "                            model.safetensors, or model-00001-of-0000N.safetensors ... with\n"
    "                            model.safetensors.index.json when the weights exceed --max-shard-size:\n"
    "                            bytes or e.g. 2GB, 500MB, 1GiB; default 50GB, as transformers'\n"
    "                            save_pretrained) into a new directory OUT,\n"
    "                            in --dtype (default: the dtype the model was imported in, else float32),\n"
    "                            with tokenizer.json, tokenizer_config.json, special_tokens_map.json and\n"
    "                            generation_config.json copied from --tokenizer-dir, else from the run's\n"
    "                            --init-from directory (a file it lacks is skipped with a note)\n"
    "  logits DIR TOKENS.npy OUT.npy\n"
    "                            run the unsharded model on int64 tokens [B, T]; write float32 logits.\n"
    "                            DIR may also be a Hugging Face model directory (config.json and\n"
    "                            safetensors, as fsdp-train --init-from reads it)\n"
    "DIR: a checkpoint directory, or a save root whose 'latest' names one.\n"
    "Exit status: 0 ok, 1 problems found / differences / errors, 2 usage errors (diff: also unreadable input).\n";

// The process's peak RSS (VmHWM), which fsdp-train's plan counts for an export (its "an export"
// phase); read before exit, whose library teardown touches pages of its own.
void print_peak_rss() {
  if (const int64_t bytes = fsdp::sysinfo::peak_rss_bytes(); bytes > 0) {
    std::printf("peak RSS: %.1f MiB\n", static_cast<double>(bytes) / (1 << 20));
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fsdp_ckpt;
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help" || std::string(argv[1]) == "help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const Args args(argv + 2, argv + argc);
  // As a training process's: buffers of 4 MiB and more return to the system when freed, so an
  // export's chunks do not stay resident in the heap (Note [Host malloc settings]).
  fsdp::base::tune_host_malloc();
  try {
    if (command == "info") {  // its peak RSS too: the process alone, for an export's to be measured against
      const int rc = run_info(args);
      print_peak_rss();
      return rc;
    }
    if (command == "verify") return run_verify(args);
    if (command == "diff") return run_diff(args);
    if (command == "export") {
      const int rc = run_export(args);
      print_peak_rss();
      return rc;
    }
    if (command == "logits") return run_logits(args);
    throw UsageError("unknown command '" + command + "'");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fsdp-ckpt: usage error: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "fsdp-ckpt: error: %s\n", e.what());
    fsdp::write_launcher_error(e);  // started by torchrun (a job step): its summary shows the error
    return command == "diff" ? 2 : 1;
  }
}
