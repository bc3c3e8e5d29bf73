// Reading the launch environment: torchrun, OpenMPI, MPICH / Intel MPI (Hydra) and Slurm variables.
// Pure parsing, no network, so a missing or malformed variable fails at once with its name.
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "fsdp/dist.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace {

class EnvReader {
 public:
  explicit EnvReader(const EnvLookup& lookup) : lookup_(lookup) {}

  bool has(const std::string& name) const {
    auto v = lookup_(name);
    return v.has_value();
  }

  std::string string(const std::string& name, const std::string& context) const {
    auto v = lookup_(name);
    if (!v) throw EnvError("fsdp: " + name + " is not set" + context);
    if (v->empty()) throw EnvError("fsdp: " + name + " is set but empty" + context);
    return *v;
  }

  int integer(const std::string& name, int lo, int hi, const std::string& context) const {
    const std::string text = string(name, context);
    errno = 0;
    char* end = nullptr;
    const long value = std::strtol(text.c_str(), &end, 10);
    if (end == text.c_str() || *end != '\0' || errno == ERANGE) {
      throw EnvError("fsdp: " + name + "='" + text + "' is not an integer" + context);
    }
    if (value < lo || value > hi) {
      throw EnvError("fsdp: " + name + "=" + text + " is out of range [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]" + context);
    }
    return static_cast<int>(value);
  }

  int optional_integer(const std::string& name, int fallback, int lo, int hi, const std::string& context) const {
    return has(name) ? integer(name, lo, hi, context) : fallback;
  }

 private:
  const EnvLookup& lookup_;
};

constexpr int kMaxInt = std::numeric_limits<int>::max();

void read_master(const EnvReader& env, DistEnv& out, const std::string& context) {
  out.master_addr = env.string("MASTER_ADDR", context);
  out.master_port = env.integer("MASTER_PORT", 1, 65535, context);
}

void check_rank(const DistEnv& out, const std::string& rank_var, const std::string& size_var) {
  if (out.rank >= out.world_size) {
    throw EnvError("fsdp: " + rank_var + "=" + std::to_string(out.rank) + " must be less than " + size_var + "=" +
                   std::to_string(out.world_size));
  }
  if (out.local_rank >= out.local_world_size) {
    throw EnvError("fsdp: local rank " + std::to_string(out.local_rank) + " must be less than the local world size " +
                   std::to_string(out.local_world_size));
  }
}

// How rank 0 gets its store: a socket the launcher handed down, or torchrun's agent store.
void read_store_hints(const EnvReader& env, DistEnv& out) {
  if (out.world_size <= 1) return;
  if (env.has("TORCHELASTIC_USE_AGENT_STORE")) {
    const std::string v = env.string("TORCHELASTIC_USE_AGENT_STORE", "");
    if (v != "True" && v != "False") {
      throw EnvError("fsdp: TORCHELASTIC_USE_AGENT_STORE='" + v + "' must be True or False (set by torchrun)");
    }
    out.agent_store = v == "True";
    out.restart_count = env.optional_integer("TORCHELASTIC_RESTART_COUNT", 0, 0, kMaxInt, " (set by torchrun)");
  }
  if (env.has("FSDP_MASTER_LISTEN_FD") && out.rank == 0 && !out.agent_store) {
    out.master_listen_fd = env.integer("FSDP_MASTER_LISTEN_FD", 0, kMaxInt,
                                       " (a socket bound on MASTER_PORT, passed down by the launcher; unset it when "
                                       "starting rank 0 by hand)");
  }
}

}  // namespace

DistEnv parse_dist_env(const EnvLookup& lookup) {
  EnvReader env(lookup);
  DistEnv out;
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    const std::string ctx = " (torchrun-style launch: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are required)";
    out.launcher = "torchrun";
    out.world_size = env.integer("WORLD_SIZE", 1, kMaxInt, ctx);
    out.rank = env.integer("RANK", 0, kMaxInt, ctx);
    out.local_world_size = env.optional_integer("LOCAL_WORLD_SIZE", out.world_size, 1, kMaxInt, ctx);
    out.local_rank = env.optional_integer("LOCAL_RANK", out.rank % out.local_world_size, 0, kMaxInt, ctx);
    if (out.world_size > 1 || env.has("MASTER_ADDR") || env.has("MASTER_PORT")) read_master(env, out, ctx);
    check_rank(out, "RANK", "WORLD_SIZE");
  } else if (env.has("OMPI_COMM_WORLD_RANK") || env.has("OMPI_COMM_WORLD_SIZE")) {
    const std::string ctx =
        " (OpenMPI launch: set MASTER_ADDR and MASTER_PORT for the rendezvous, e.g. mpirun -x MASTER_ADDR -x "
        "MASTER_PORT)";
    out.launcher = "openmpi";
    out.world_size = env.integer("OMPI_COMM_WORLD_SIZE", 1, kMaxInt, ctx);
    out.rank = env.integer("OMPI_COMM_WORLD_RANK", 0, kMaxInt, ctx);
    out.local_world_size = env.optional_integer("OMPI_COMM_WORLD_LOCAL_SIZE", out.world_size, 1, kMaxInt, ctx);
    out.local_rank = env.optional_integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, 0, kMaxInt, ctx);
    if (out.world_size > 1) read_master(env, out, ctx);
    check_rank(out, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
  } else if ((env.has("PMI_RANK") || env.has("PMI_SIZE")) &&
             (env.has("MPI_LOCALRANKID") || !(env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")))) {
    // Hydra's mpiexec (MPICH, Intel MPI) sets PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS;
    // its ranks may inherit a batch script's SLURM_* too, which then describe the script, not them.
    // srun --mpi=pmi2 sets PMI_RANK without MPI_LOCALRANKID: its own SLURM_* are read below.
    const std::string ctx =
        " (MPICH / Intel MPI launch: export MASTER_ADDR and MASTER_PORT before mpiexec, or pass them with -genv)";
    out.launcher = "mpich";
    out.world_size = env.integer("PMI_SIZE", 1, kMaxInt, ctx);
    out.rank = env.integer("PMI_RANK", 0, kMaxInt, ctx);
    out.local_world_size = env.optional_integer("MPI_LOCALNRANKS", out.world_size, 1, kMaxInt, ctx);
    out.local_rank = env.optional_integer("MPI_LOCALRANKID", 0, 0, kMaxInt, ctx);
    if (out.world_size > 1) read_master(env, out, ctx);
    check_rank(out, "PMI_RANK", "PMI_SIZE");
  } else if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) {
    const std::string ctx =
        " (Slurm launch: export MASTER_ADDR (e.g. the first host of $SLURM_JOB_NODELIST) and MASTER_PORT before srun)";
    out.launcher = "slurm";
    out.world_size = env.integer("SLURM_NTASKS", 1, kMaxInt, ctx);
    out.rank = env.integer("SLURM_PROCID", 0, kMaxInt, ctx);
    out.local_world_size = out.world_size;  // SLURM_NTASKS_PER_NODE may read "2(x3)"; not needed
    out.local_rank = env.optional_integer("SLURM_LOCALID", 0, 0, kMaxInt, ctx);
    if (out.world_size > 1) read_master(env, out, ctx);
    check_rank(out, "SLURM_PROCID", "SLURM_NTASKS");
  }
  read_store_hints(env, out);
  return out;
}

DistEnv parse_dist_env() {
  return parse_dist_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace fsdp
