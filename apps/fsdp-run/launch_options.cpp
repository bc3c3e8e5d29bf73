// fsdp-run's command line: parsing, validation and the --help text.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <stdexcept>

#include "launcher_internal.h"

namespace fsdp {
namespace launch {
namespace {

constexpr double kMaxSeconds = 1e8;  // keeps the conversion to Clock::duration from overflowing

long parse_integer(const std::string& flag, const std::string& text, long lo, long hi, const char* expected) {
  const bool digits = !text.empty() && text.size() <= 9 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  const long value = digits ? std::strtol(text.c_str(), nullptr, 10) : 0;
  if (!digits || value < lo || value > hi) {
    throw std::invalid_argument(flag + " must be " + expected + ", got '" + text + "'");
  }
  return value;
}

double parse_seconds(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const double value = text.empty() ? -1 : std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || *end != '\0' || !std::isfinite(value) || value < 0 || value > kMaxSeconds) {
    throw std::invalid_argument(flag + " must be a number of seconds in [0, " + format_seconds(kMaxSeconds) +
                                "], got '" + text + "'");
  }
  return value;
}

}  // namespace

void validate(const LaunchOptions& options) {
  if (options.nproc_per_node < 1 || options.nproc_per_node > kMaxProcsPerNode) {
    throw std::invalid_argument("--nproc-per-node must be an integer in [1, " + std::to_string(kMaxProcsPerNode) +
                                "], got " + std::to_string(options.nproc_per_node));
  }
  if (options.command.empty()) {
    throw std::invalid_argument(std::string("missing command after '--'; usage: ") + kSynopsis);
  }
  if (options.master_addr.empty()) throw std::invalid_argument("--master-addr must not be empty");
  if (options.master_port < 0 || options.master_port > 65535) {
    throw std::invalid_argument("--master-port must be in [1, 65535], got " + std::to_string(options.master_port));
  }
  if (!(options.timeout_s >= 0 && options.timeout_s <= kMaxSeconds) ||
      !(options.grace_s >= 0 && options.grace_s <= kMaxSeconds)) {
    throw std::invalid_argument("--timeout-s and --grace-s must be in [0, " + format_seconds(kMaxSeconds) +
                                "] seconds");
  }
}

}  // namespace launch

using launch::kSynopsis;

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions options;
  bool saw_nproc = false;
  size_t i = 0;
  for (; i < args.size() && args[i] != "--"; ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      options.show_help = true;
      return options;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      throw std::invalid_argument("unexpected argument '" + arg +
                                  "': the command goes after '--'; usage: " + kSynopsis);
    }
    const size_t equals = arg.find('=');
    std::string flag = arg.substr(0, equals);
    std::replace(flag.begin(), flag.end(), '_', '-');  // torchrun accepts --nproc_per_node too
    static const char* const kFlags[] = {"--nproc-per-node", "--master-addr", "--master-port", "--timeout-s",
                                         "--grace-s"};
    if (std::none_of(std::begin(kFlags), std::end(kFlags), [&](const char* f) { return flag == f; })) {
      throw std::invalid_argument("unknown option '" + arg.substr(0, equals) + "' (see fsdp-run --help)");
    }
    std::string value;
    if (equals != std::string::npos) {
      value = arg.substr(equals + 1);
    } else if (i + 1 < args.size() && args[i + 1] != "--") {
      value = args[++i];
    } else {
      throw std::invalid_argument("option " + flag + " needs a value");
    }
    if (flag == "--nproc-per-node") {
      options.nproc_per_node = static_cast<int>(
          launch::parse_integer(flag, value, 1, kMaxProcsPerNode,
                                ("a positive integer (at most " + std::to_string(kMaxProcsPerNode) + ")").c_str()));
      saw_nproc = true;
    } else if (flag == "--master-addr") {
      if (value.empty()) throw std::invalid_argument("--master-addr must not be empty");
      options.master_addr = value;
    } else if (flag == "--master-port") {
      options.master_port = static_cast<int>(launch::parse_integer(flag, value, 1, 65535, "an integer in [1, 65535]"));
    } else if (flag == "--timeout-s") {
      options.timeout_s = launch::parse_seconds(flag, value);
    } else {
      options.grace_s = launch::parse_seconds(flag, value);
    }
  }
  if (i == args.size()) {
    throw std::invalid_argument(std::string("missing '--' before the command; usage: ") + kSynopsis);
  }
  if (!saw_nproc) throw std::invalid_argument(std::string("--nproc-per-node is required; usage: ") + kSynopsis);
  options.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  launch::validate(options);
  return options;
}

std::string launch_usage() {
  return std::string("usage: ") + kSynopsis + R"(

Runs CMD once per rank on this machine, with the environment torchrun gives its workers:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, ROLE_RANK, ROLE_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID=fsdp-run (rank 0 also FSDP_MASTER_LISTEN_FD,
see --master-port), and OMP_NUM_THREADS unless it is set: the cores fsdp-run may use divided
among the ranks (at least 1), the intra-op threads LibTorch gives each rank, as torchrun sets 1
for several workers; it prints the value it chose. SIGINT and SIGTERM are forwarded to every rank, which then gets the grace
period to finish (e.g. save a checkpoint) before SIGKILL. Every line a rank prints is forwarded
with a "[rank K] " prefix (stdout to stdout, stderr to stderr). The first rank that fails stops
the job: the other ranks' process groups get SIGTERM, then SIGKILL after the grace period.
A rank that dies of a SIGKILL fsdp-run did not send (the kernel's out-of-memory killer, most
often) is explained: whether the OOM killer's counters moved (/proc/vmstat, the memory cgroup)
and the kernel log's line when readable, the rank's last sampled resident memory (sampled every
0.25 s), the machine's and the cgroup's memory, and the plan the rank wrote to the file named by
FSDP_RUN_PLAN_FILE, which fsdp-run sets for each rank (fsdp-train writes its plan there).

options:
  --nproc-per-node N   number of ranks to start, 1..1024 (required)
  --master-addr A      rendezvous address (default 127.0.0.1)
  --master-port P      rendezvous port (default: a port the launcher keeps bound and hands to
                       rank 0 as the socket FSDP_MASTER_LISTEN_FD, which fsdp programs host
                       their store on; a program that binds MASTER_PORT itself needs this flag)
  --timeout-s T        stop the job after T seconds; 0 = no limit (default 0)
  --grace-s G          seconds between SIGTERM and SIGKILL (default 5)
  -h, --help           show this help
Flags may also be written --flag=value, and with '_' for '-'.

exit status:
  0      every rank exited 0
  C      the first failing rank's exit code, when it is 1..123
  1      the first failing rank exited with 124..255 or was killed by a signal
  2      bad usage, or the launcher could not start the job
  124    --timeout-s expired
  128+S  the launcher received signal S (130: SIGINT, 143: SIGTERM)
)";
}

}  // namespace fsdp
