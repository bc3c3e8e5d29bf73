#!/usr/bin/env bash
# fsdp-train under the real launchers, each compared with the same job under fsdp-run (losses equal
# bit for bit):
#  - torchrun --standalone --nproc-per-node 2 --no-python fsdp-train;
#  - two torchrun agents on this host as two nodes (--nnodes 2, --node-rank 0/1, c10d rendezvous
#    backend, one process each);
#  - torchrun --max-restarts 1 with one rank SIGKILLed mid-run: the agent restarts the job, which
#    resumes from the latest checkpoint by itself (--resume latest from the first launch on: with no
#    checkpoint yet it starts fresh) and ends with the uninterrupted run's losses and checkpoint;
#  - torchrun with rank 1 failing on a bad config key: torchrun's summary shows fsdp-train's error
#    (TORCHELASTIC_ERROR_FILE);
#  - OpenMPI's mpirun when it is installed, else the environment it sets up; Slurm's environment
#    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), as srun sets it without a running cluster; MPICH's
#    and Intel MPI's mpiexec (Hydra) when installed, else its environment (PMI_RANK, PMI_SIZE,
#    MPI_LOCALRANKID, MPI_LOCALNRANKS).
# Usage: FSDP_RUN=... FSDP_TRAIN=... FSDP_CKPT=... FSDP_TORCHRUN=.venv/bin/torchrun \
#        FSDP_PYTHON=.venv/bin/python tests/e2e/launchers_e2e_test.sh        (ctest sets them)
set -u

HERE=$(dirname "${BASH_SOURCE[0]}")
. "$HERE/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN FSDP_CKPT FSDP_TORCHRUN FSDP_PYTHON
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
CKPT=$FSDP_CKPT
TORCHRUN=$FSDP_TORCHRUN
PY=$FSDP_PYTHON
scratch_dir launchers-e2e  # TMP, also the marker in every command line started here
export OMP_NUM_THREADS=1

TINY=(--set model.vocab_size=64 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set data.seq_len=16 --set data.batch_size_per_rank=4 --set train.eval_every=0 --set train.log_every=1
      --set optim.warmup_steps=2 --set fsdp.timeout_s=30)
STEPS=6

# same_as REF RUN NAME [DETAIL...]: records NAME, passing when RUN's losses equal REF's bit for bit.
same_as() {
  local ref=$1 run=$2 name=$3
  shift 3
  local ok=0
  python3 "$HERE/support/same_losses.py" "$ref" "$run" >"$run.same" 2>&1 && ok=1
  record "$name ($(cat "$run.same"))" $ok "$run.same" "$@"
}

# The reference: the same job under fsdp-run.
"$RUN" --nproc-per-node 2 -- "$TRAIN" "${TINY[@]}" --steps $STEPS --metrics "$TMP/ref.jsonl" \
  >"$TMP/ref.out" 2>&1 </dev/null
record "reference run under fsdp-run" $([ $? -eq 0 ] && echo 1 || echo 0) "$TMP/ref.out"

# ---- torchrun --standalone ---------------------------------------------------------------------------
timeout -k 5 180 "$TORCHRUN" --standalone --nproc-per-node 2 --no-python "$TRAIN" "${TINY[@]}" --steps $STEPS \
  --metrics "$TMP/standalone.jsonl" >"$TMP/standalone.out" 2>&1 </dev/null
rc=$?
same_as "$TMP/ref.jsonl" "$TMP/standalone.jsonl" "torchrun --standalone, 2 processes (exit $rc): same losses as fsdp-run" \
  "$TMP/standalone.out"

# ---- torchrun's summary names a failing rank's error ----------------------------------------------------
# Rank 1 alone gets a config key that does not exist; it writes its error to TORCHELASTIC_ERROR_FILE,
# which torchrun's failure summary prints as the root cause ("traceback : ..."), rather than only
# "exitcode: 2". Rank 0, left waiting for it, times out 5 s later (its own error comes second).
timeout -k 5 120 "$TORCHRUN" --standalone --nproc-per-node 2 --no-python bash -c \
  'if [ "$RANK" = 1 ]; then exec "$0" "$@" --set train.no_such_key=1; else exec "$0" "$@"; fi' \
  "$TRAIN" "${TINY[@]}" --set fsdp.timeout_s=5 --steps $STEPS >"$TMP/failing.out" 2>&1 </dev/null
rc=$?
msg=$(grep -m 1 "train.no_such_key" "$TMP/failing.out" | sed -n 's/^fsdp-train: error: //p')
ok=0
if [ "$rc" -ne 0 ] && [ -n "$msg" ] && sed -n '/Root Cause/,$p' "$TMP/failing.out" | grep -qF "traceback : $msg" &&
   grep -q "error_file: .*/1/error.json" "$TMP/failing.out"; then
  ok=1
fi
record "torchrun, rank 1 fails on a bad config key (exit $rc): torchrun's summary shows fsdp-train's error" $ok \
  "$TMP/failing.out"

# ---- two torchrun agents as two nodes ----------------------------------------------------------------
# The rendezvous endpoint is a store that a helper hosts on a port the kernel chose (published in a
# file), so no port is picked and released first; both agents join it as clients (is_host=false).
"$PY" -c '
import datetime, os, signal, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=120))
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(store.port))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
signal.pause()
' "$TMP/rdzv.port" >"$TMP/rdzv.out" 2>&1 &
rdzv=$!
ok=0
if wait_for_file "$TMP/rdzv.port" 60; then
  endpoint=127.0.0.1:$(cat "$TMP/rdzv.port")
  for node in 0 1; do
    timeout -k 5 180 "$TORCHRUN" --nnodes 2 --node-rank $node --nproc-per-node 1 --rdzv-backend c10d \
      --rdzv-endpoint "$endpoint" --rdzv-id "two-nodes-$$" --rdzv-conf is_host=false --no-python "$TRAIN" \
      "${TINY[@]}" --steps $STEPS --metrics "$TMP/nodes.jsonl" >"$TMP/node$node.out" 2>&1 </dev/null &
    eval "agent$node=\$!"
  done
  wait "$agent0"
  rc0=$?
  wait "$agent1"
  rc1=$?
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] && ok=1
fi
kill "$rdzv" 2>/dev/null
wait "$rdzv" 2>/dev/null
record "two torchrun agents (--nnodes 2, c10d rendezvous) exit 0" $ok "$TMP/node0.out" "$TMP/node1.out" "$TMP/rdzv.out"
same_as "$TMP/ref.jsonl" "$TMP/nodes.jsonl" "two torchrun agents, 1 process each: same losses as fsdp-run" \
  "$TMP/node0.out" "$TMP/node1.out"

# ---- torchrun --max-restarts 1, one rank killed mid-run ------------------------------------------------
# Long enough (about 2 s) that the kill, once the first checkpoint exists, lands mid-run even when
# this script is slow to notice.
R_STEPS=150
R_ARGS=("${TINY[@]}" --steps $R_STEPS --set train.save_every=5 --set train.keep_last=2)
"$RUN" --nproc-per-node 2 -- "$TRAIN" "${R_ARGS[@]}" --save-dir "$TMP/restart-ref" \
  --metrics "$TMP/restart-ref.jsonl" >"$TMP/restart-ref.out" 2>&1 </dev/null
timeout -k 5 240 "$TORCHRUN" --standalone --nproc-per-node 2 --max-restarts 1 --no-python "$TRAIN" "${R_ARGS[@]}" \
  --save-dir "$TMP/restart" --resume latest --metrics "$TMP/restart.jsonl" >"$TMP/restart.out" 2>&1 </dev/null &
agent=$!
ok=0
killed=""
for i in $(seq 1200); do  # until the first checkpoint is committed and a step beyond it is done
  if [ -f "$TMP/restart/latest" ] && [ -f "$TMP/restart.jsonl" ] && [ "$(wc -l <"$TMP/restart.jsonl")" -ge 6 ]; then
    for p in $(pgrep -f -- "$TRAIN.*$TMP/restart "); do
      if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=1"; then
        killed=$(wc -l <"$TMP/restart.jsonl")
        t_kill=$(( $(date +%s%N) / 1000000 ))
        kill -KILL "$p"
        break
      fi
    done
    break
  fi
  sleep 0.05
done
t_resumed=-1
if [ -n "$killed" ]; then  # the restarted job says where it resumed, then appends a line per step
  n0=""
  for i in $(seq 2400); do
    if [ -z "$n0" ] && grep -q "resumed from" "$TMP/restart.out"; then n0=$(wc -l <"$TMP/restart.jsonl"); fi
    if [ -n "$n0" ] && [ "$(wc -l <"$TMP/restart.jsonl")" -gt "$n0" ]; then
      t_resumed=$(( $(date +%s%N) / 1000000 - t_kill ))
      break
    fi
    kill -0 "$agent" 2>/dev/null || break
    sleep 0.05
  done
fi
wait "$agent"
rc=$?
echo "time: torchrun, rank 1 SIGKILLed -> first step of the restarted job done after ${t_resumed} ms"
if [ -n "$killed" ] && [ "$rc" -eq 0 ]; then ok=1; fi
grep -q "no checkpoint in $TMP/restart yet, starting at step 0" "$TMP/restart.out" || ok=0
grep -q "resumed from $TMP/restart/step-" "$TMP/restart.out" || ok=0
"$CKPT" diff "$TMP/restart-ref" "$TMP/restart" >"$TMP/restart.diff" 2>&1 || ok=0
record "torchrun --max-restarts 1, rank 1 SIGKILLed after $killed steps: the restart resumes from the latest checkpoint, exit $rc, final checkpoint equal" \
  $ok "$TMP/restart.out" "$TMP/restart.diff"
same_as "$TMP/restart-ref.jsonl" "$TMP/restart.jsonl" "torchrun restart: every step, recomputed ones too, equals the uninterrupted run" \
  "$TMP/restart.out"

# ---- OpenMPI and Slurm ---------------------------------------------------------------------------------
# Both leave the rendezvous to MASTER_ADDR/MASTER_PORT, with rank 0 hosting the store. Each rank
# runs through tests/e2e/support/rank_by_env.sh: rank 0 holds a port the kernel chose and hosts the
# store on it (FSDP_MASTER_LISTEN_FD), the others read the port from a file, so no port is picked
# in advance.
RANK_SH=$HERE/support/rank_by_env.sh
if command -v mpirun >/dev/null; then
  timeout -k 5 120 mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS \
    bash "$RANK_SH" OMPI_COMM_WORLD_RANK "$TMP/mpi.port" "$TRAIN" "${TINY[@]}" --steps $STEPS \
    --metrics "$TMP/mpi.jsonl" >"$TMP/mpi.out" 2>&1 </dev/null
  what="mpirun -np 2 (exit $?)"
else
  # What mpirun sets for each rank (scripts/setup installs it; this covers a machine without it).
  for r in 0 1; do
    OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=$r OMPI_COMM_WORLD_LOCAL_SIZE=2 \
      timeout -k 5 120 bash "$RANK_SH" OMPI_COMM_WORLD_RANK "$TMP/mpi.port" "$TRAIN" "${TINY[@]}" --steps $STEPS \
      --metrics "$TMP/mpi.jsonl" >"$TMP/mpi.r$r.out" 2>&1 </dev/null &
  done
  wait
  cat "$TMP"/mpi.r*.out >"$TMP/mpi.out"
  what="OpenMPI's environment (mpirun is not installed)"
fi
same_as "$TMP/ref.jsonl" "$TMP/mpi.jsonl" "$what: same losses as fsdp-run" "$TMP/mpi.out"

# Slurm: srun needs slurmctld and slurmd running, which this test does not set up; each task gets
# the environment srun gives it (SLURM_NTASKS_PER_NODE in srun's compact form, which fsdp ignores).
for r in 0 1; do
  SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_LOCALID=$r SLURM_NTASKS_PER_NODE="2(x1)" SLURM_JOB_NODELIST=localhost \
    timeout -k 5 120 bash "$RANK_SH" SLURM_PROCID "$TMP/slurm.port" "$TRAIN" "${TINY[@]}" --steps $STEPS \
    --metrics "$TMP/slurm.jsonl" >"$TMP/slurm.r$r.out" 2>&1 </dev/null &
done
wait
same_as "$TMP/ref.jsonl" "$TMP/slurm.jsonl" "Slurm's environment (SLURM_PROCID/NTASKS/LOCALID, as srun sets it): same losses as fsdp-run" \
  "$TMP/slurm.r0.out" "$TMP/slurm.r1.out"

# MPICH and Intel MPI: Hydra's mpiexec gives each rank PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and
# MPI_LOCALNRANKS; the real mpiexec when MPICH's is installed, else that environment.
hydra=$(command -v mpiexec.hydra || command -v mpiexec.mpich || true)
if [ -n "$hydra" ]; then
  timeout -k 5 120 "$hydra" -n 2 -genv OMP_NUM_THREADS 1 \
    bash "$RANK_SH" PMI_RANK "$TMP/hydra.port" "$TRAIN" "${TINY[@]}" --steps $STEPS \
    --metrics "$TMP/hydra.jsonl" >"$TMP/hydra.out" 2>&1 </dev/null
  what="$(basename "$hydra") -n 2 (exit $?)"
else
  for r in 0 1; do
    PMI_RANK=$r PMI_SIZE=2 MPI_LOCALRANKID=$r MPI_LOCALNRANKS=2 \
      timeout -k 5 120 bash "$RANK_SH" PMI_RANK "$TMP/hydra.port" "$TRAIN" "${TINY[@]}" --steps $STEPS \
      --metrics "$TMP/hydra.jsonl" >"$TMP/hydra.r$r.out" 2>&1 </dev/null &
  done
  wait
  cat "$TMP"/hydra.r*.out >"$TMP/hydra.out"
  what="MPICH's and Intel MPI's environment (PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/MPI_LOCALNRANKS; no mpiexec.hydra)"
fi
same_as "$TMP/ref.jsonl" "$TMP/hydra.jsonl" "$what: same losses as fsdp-run" "$TMP/hydra.out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
