// fsdp-run, the local launcher: starts one process per rank with the environment torchrun gives
// its workers, forwards each rank's output line by line behind a "[rank K] " prefix, and tears the
// whole job down (SIGTERM, a grace period, then SIGKILL) on the first failing rank, on --timeout-s
// or on SIGINT/SIGTERM, so that no rank and nothing a rank spawned outlives the launcher.
// Pure C++17 and POSIX on purpose: the launcher builds without LibTorch and never holds a device.
#pragma once

#include <string>
#include <vector>

namespace fsdp {

// Exit status of fsdp-run, decided by the first event that stops the job:
//   0       every rank exited 0;
//   C       the first failing rank exited with C, 1 <= C <= 123 (passed through unchanged);
//   1       the first failing rank exited with 124..255 or was killed by a signal (124 and up are
//           kept for the launcher's own outcomes below; 126/127 are also the shell's "cannot
//           execute"/"not found", which the launcher reports on stderr instead);
//   2       bad usage, or the launcher itself could not start the job (fsdp_run_main.cpp);
//   124     --timeout-s expired (as timeout(1) does);
//   128+S   the launcher received signal S and stopped the job: 130 for SIGINT, 143 for SIGTERM.
// The last stderr line ("fsdp-run: rank K failed first (...)", "fsdp-run: timed out after T s",
// ...) is authoritative where a rank's code collides with 2.
constexpr int kExitLauncherError = 2;
constexpr int kExitTimeout = 124;
constexpr int kMaxRankExitCodePassedThrough = 123;
constexpr int kMaxProcsPerNode = 1024;

// One fsdp-run invocation. Internal options: a plain aggregate, validated by parse_launch_args
// (and again by run_launcher, for callers that fill it by hand).
struct LaunchOptions {
  int nproc_per_node = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;               // 0: pick a free port on 127.0.0.1 at launch time
  double timeout_s = 0;              // wall-clock limit for the whole job; 0: none
  double grace_s = 5;                // between the polite signal and SIGKILL
  std::vector<std::string> command;  // CMD ARGS..., everything after "--"
  bool show_help = false;            // --help was given; nothing else is validated then
};

// Parses the arguments after argv[0]. Throws std::invalid_argument naming the offending flag or
// value (unknown flag, missing "--", missing command, N not a positive integer, ...).
LaunchOptions parse_launch_args(const std::vector<std::string>& args);

// The text printed for --help.
std::string launch_usage();

// Runs the job to completion and returns the exit status described above. Throws
// std::runtime_error when the launcher itself fails (no socket, fork or pipe failed); any rank
// already started is killed and reaped before the exception leaves.
int run_launcher(const LaunchOptions& options);

}  // namespace fsdp
