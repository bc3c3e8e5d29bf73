// Process-group set-up: reading the launch environment (torchrun, Slurm, OpenMPI, MPICH / Intel MPI), TCPStore
// rendezvous, and the `Dist` context that owns the world communicator. Nothing here is global:
// a `Dist` is passed explicitly to the mesh and everything built on it.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <torch/arg.h>

#include "fsdp/comm.h"

namespace c10d {
class Store;
}

namespace fsdp {

// Where this process sits in the job, as read from the environment.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  // "torchrun", "openmpi", "mpich" (Hydra's mpiexec: MPICH, Intel MPI), "slurm", or "none" (no
  // variables: a single process).
  std::string launcher = "none";
  // FSDP_MASTER_LISTEN_FD: a socket already bound (and usually listening) on MASTER_PORT that
  // rank 0 hosts the store on, handed down by the launcher so that no other process can take the
  // port between its choice and its use (fsdp-run does this). -1: rank 0 binds MASTER_PORT itself.
  int master_listen_fd = -1;
  // torchrun's TORCHELASTIC_USE_AGENT_STORE=True: its agent already hosts the store on
  // MASTER_PORT, so every rank, rank 0 included, joins it as a client; keys live under a prefix
  // per TORCHELASTIC_RESTART_COUNT, as the agent keeps its store across restarts.
  bool agent_store = false;
  int restart_count = 0;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the launch environment. Precedence: torchrun's RANK/WORLD_SIZE, then OpenMPI's
// OMPI_COMM_WORLD_*, then MPICH's and Intel MPI's PMI_RANK/PMI_SIZE (local rank and size from
// Hydra's MPI_LOCALRANKID/MPI_LOCALNRANKS; skipped for srun --mpi=pmi2, which sets PMI_RANK but
// not MPI_LOCALRANKID, in favour of its SLURM_*), then Slurm's SLURM_PROCID/SLURM_NTASKS; none of
// them means one process. Under MPI and Slurm, MASTER_ADDR/MASTER_PORT are exported by the user
// (torchrun sets them itself).
// Throws EnvError naming the variable when one is missing, not an integer, or out of range.
// Touches no network, so a bad environment fails at once.
DistEnv parse_dist_env(const EnvLookup& lookup);
DistEnv parse_dist_env();  // from the process environment

struct InitOptions;
// Throws ConfigError naming the first invalid option (timeout > 0 ms). init_process_group and
// init_from_env call it; a config parser calls it to check early.
void check_options(const InitOptions& options);

struct InitOptions {
  // Bound on the rendezvous and on every collective; errors name what timed out.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(60);
  // Gloo threads per process group.
  TORCH_ARG(int, gloo_threads) = 2;
  // How CPU collectives travel between ranks: "auto" puts the ranks of one host in touch through
  // shared memory (POSIX, /dev/shm) and ranks on different hosts over Gloo; "gloo" uses Gloo
  // everywhere. The environment variable FSDP_CPU_TRANSPORT overrides it. Results are bitwise the
  // same either way.
  TORCH_ARG(std::string, cpu_transport) = "auto";
  // Ranks with the same host id share memory; empty means detected (hostname, boot id, /dev/shm).
  // Set distinct ids for ranks of one machine that cannot share /dev/shm (separate containers);
  // FSDP_HOST_ID in the environment overrides it.
  TORCH_ARG(std::string, host_id) = "";
  // "cpu": collectives over Gloo (CPU tensors). "cuda": over NCCL (CUDA tensors; CUDA builds only,
  // set the rank's CUDA device first, e.g. from LOCAL_RANK).
  TORCH_ARG(std::string, device) = "cpu";
  // Debug option: check before every collective that all ranks issue the same one (a fingerprint
  // exchange; a mismatch or a skipped collective fails naming the ranks, ops and tags). Also on
  // when the environment has FSDP_CHECK_COLLECTIVES=1. Costs one small all-gather and one store
  // write per collective.
  TORCH_ARG(bool, check_collectives) = false;
};

// One process's membership in a job: its rank, the store, and the world communicator.
class Dist {
 public:
  // Joins with an existing store (tests use a FileStore; ranks may be threads of one process).
  static std::shared_ptr<Dist> from_store(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                          const InitOptions& options = {});
  // A single process: every collective is a local copy.
  static std::shared_ptr<Dist> single(const InitOptions& options = {});

  ~Dist();
  Dist(const Dist&) = delete;
  Dist& operator=(const Dist&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return env_.local_rank; }
  const DistEnv& env() const { return env_; }
  const InitOptions& options() const { return options_; }
  // Where this rank computes: CPU for InitOptions::device "cpu"; for "cuda", the CUDA device that
  // was current when the Dist was made (set it, e.g. from LOCAL_RANK, before; NCCL binds to it).
  // Sharded params, their gathered buffers and gradients live there; move inputs there. Making a
  // Dist with "cuda" and no usable CUDA device throws ConfigError.
  const c10::Device& compute_device() const { return device_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  Communicator& world() { return *world_; }
  // A communicator over `ranks` (global ranks, ascending); call on every member, in the same order
  // on all of them. `name` must be unique per group and the same on every member.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks, const std::string& name);
  // A communicator over every rank, created on first use and cached by name. Work that runs
  // beside training (e.g. a background checkpoint) uses its own, so its collectives never
  // interleave with training's. Always over Gloo (host tensors), whatever InitOptions::device.
  // Call at the same point on every rank.
  Communicator& side_group(const std::string& name);

 private:
  Dist(DistEnv env, c10::intrusive_ptr<c10d::Store> store, const InitOptions& options);
  std::string gloo_host() const;  // the address Gloo binds to: loopback for local jobs

  DistEnv env_;
  int rank_;
  int world_size_;
  InitOptions options_;
  c10::Device device_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<Communicator> world_;
  std::map<std::string, std::shared_ptr<Communicator>> side_groups_;

  friend std::shared_ptr<Dist> init_process_group(const DistEnv&, const InitOptions&);
};

// Joins the job described by `env`: TCPStore on MASTER_ADDR:MASTER_PORT (rank 0 hosts it), a join
// check that names the ranks that never arrived within the timeout, then the world process group.
std::shared_ptr<Dist> init_process_group(const DistEnv& env, const InitOptions& options = {});

// parse_dist_env() + init_process_group().
std::shared_ptr<Dist> init_from_env(const InitOptions& options = {});

}  // namespace fsdp
