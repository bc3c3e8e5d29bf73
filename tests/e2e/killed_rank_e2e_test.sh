#!/usr/bin/env bash
# A rank killed without a word: fsdp-run explains a SIGKILL it did not send (apps/fsdp-run/
# launch_memory.cpp, Note [A rank killed without a word]).
#   1. A rank that SIGKILLs itself: fsdp-run says it did not send the signal, whether the OOM
#      killer's counters moved (here they cannot have), the rank's last sampled memory and the plan
#      the rank wrote to FSDP_RUN_PLAN_FILE.
#   2. fsdp-train under a memory cgroup limited below what it needs: the kernel's OOM killer kills
#      a rank during the load. fsdp-train has printed its plan line first (stdout flushed line by
#      line into the launcher's pipe), and fsdp-run says outright that the OOM killer killed the
#      rank, with its memory and plan. Needs a memory cgroup this script can create (root, cgroup v1
#      or v2 with the memory controller); without one the case says SKIP and why.
#   3. A rank that ignores SIGTERM and is SIGKILLed by fsdp-run itself: no such explanation.
# Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train tests/e2e/killed_rank_e2e_test.sh
#        (ctest sets both; about 10 s; "N passed, M failed")
set -u

. "$(dirname "${BASH_SOURCE[0]}")/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN
TMP=$(mktemp -d)
CGROUP=""
cleanup() {
  if [ -n "$CGROUP" ] && [ -d "$CGROUP" ]; then
    # Its processes are gone once fsdp-run returned; a moment for the kernel to see that.
    for _ in $(seq 20); do rmdir "$CGROUP" 2>/dev/null && break; sleep 0.1; done
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1
export TMPDIR=$TMP  # fsdp-run's folder of plans goes here, and must be gone after each run

has() { grep -q -- "$2" "$1"; }
no_plan_folder_left() { [ -z "$(find "$TMP" -maxdepth 1 -name 'fsdp-run-*' -print -quit)" ]; }

# 1. A SIGKILL from the rank itself.
timeout -k 5 60 "$FSDP_RUN" --nproc-per-node 2 -- bash -c \
  'echo "the plan of rank $RANK" > "$FSDP_RUN_PLAN_FILE"; sleep 0.6; if [ "$RANK" = 1 ]; then kill -KILL $$; fi; sleep 5' \
  >"$TMP/self.out" 2>"$TMP/self.err" </dev/null
rc=$?
ok=1
[ "$rc" -eq 1 ] || ok=0
has "$TMP/self.err" "rank 1 was killed by SIGKILL, which fsdp-run did not send" || ok=0
if grep -q '^oom_kill ' /proc/vmstat; then
  has "$TMP/self.err" "and not by the kernel's out-of-memory killer (/proc/vmstat oom_kill" || ok=0
else
  has "$TMP/self.err" "the kernel's out-of-memory killer is the likely cause" || ok=0
fi
grep -Eq "rank 1's resident memory at its last sample, [0-9.]+ s before it died: [0-9.]+ MiB \(peak [0-9.]+ MiB\); all ranks together [0-9.]+ MiB" \
  "$TMP/self.err" || ok=0
has "$TMP/self.err" "rank 1's plan: the plan of rank 1" || ok=0
no_plan_folder_left || ok=0
record "a rank's own SIGKILL: not sent by fsdp-run, the OOM counters read, its memory and plan named (rc=$rc)" \
  "$ok" "$TMP/self.err"

# 2. The kernel's OOM killer, under a memory cgroup of 500 MiB for the launcher and both ranks of a
# model that needs 3.6 GiB per rank.
memcg_dir() {
  local v1 v2
  v1=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
  v2=$(awk -F: '$1 == "0" && $2 == "" {print $3}' /proc/self/cgroup)
  if [ -n "$v1" ] && [ -w "/sys/fs/cgroup/memory$v1" ]; then
    echo "v1 /sys/fs/cgroup/memory$v1"
  elif [ -n "$v2" ] && [ -f "/sys/fs/cgroup$v2/cgroup.controllers" ] && [ -w "/sys/fs/cgroup$v2" ] &&
       grep -qw memory "/sys/fs/cgroup$v2/cgroup.subtree_control"; then
    echo "v2 /sys/fs/cgroup$v2"
  fi
}
read -r version parent <<<"$(memcg_dir)"
limit=$((500 << 20))
if [ -n "${parent:-}" ] && mkdir "$parent/fsdp-killed-rank-test-$$" 2>/dev/null; then
  CGROUP="$parent/fsdp-killed-rank-test-$$"
  if [ "$version" = v1 ]; then echo "$limit" >"$CGROUP/memory.limit_in_bytes"; else echo "$limit" >"$CGROUP/memory.max"; fi
  timeout -k 5 120 bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' _ "$CGROUP" \
    "$FSDP_RUN" --nproc-per-node 2 -- "$FSDP_TRAIN" --steps 3 --set data.seq_len=64 \
    --set model.vocab_size=32000 --set model.hidden_size=1024 --set model.intermediate_size=2816 \
    --set model.num_hidden_layers=8 --set model.num_attention_heads=8 --set model.num_key_value_heads=8 \
    >"$TMP/oom.out" 2>"$TMP/oom.err" </dev/null
  rc=$?
  ok=1
  [ "$rc" -eq 1 ] || ok=0
  # fsdp-train printed its plan before the load, and it reached the launcher.
  has "$TMP/oom.out" "\[rank 0\] plan per rank for the training step: memory " || ok=0
  grep -Eq "rank [01] was killed by (the kernel's out-of-memory killer; the kernel log says: .*Killed process|SIGKILL, which fsdp-run did not send; the kernel's out-of-memory killer killed during this run)" \
    "$TMP/oom.err" || ok=0
  grep -Eq "rank [01]'s resident memory at its last sample" "$TMP/oom.err" || ok=0
  has "$TMP/oom.err" "memory cgroup (.*fsdp-killed-rank-test-$$) is limited to 500.0 MiB" || ok=0
  grep -Eq "rank [01]'s plan: plan per rank for the training step: memory [0-9.]+ MiB; fits: FULL_SHARD over 2 rank" \
    "$TMP/oom.err" || ok=0
  no_plan_folder_left || ok=0
  record "the OOM killer under a 500 MiB memory cgroup: said outright, with the plan fsdp-train printed first (rc=$rc)" \
    "$ok" "$TMP/oom.out" "$TMP/oom.err"
else
  echo "SKIP: the OOM killer case needs a memory cgroup this script can create (found: '${parent:-none}')"
fi

# 3. fsdp-run's own SIGKILL, after the grace period, is not explained as someone else's.
timeout -k 5 60 "$FSDP_RUN" --nproc-per-node 2 --grace-s 0.5 -- bash -c \
  'trap "" TERM; if [ "$RANK" = 1 ]; then sleep 0.3; exit 3; fi; sleep 5' \
  >"$TMP/own.out" 2>"$TMP/own.err" </dev/null
rc=$?
ok=1
[ "$rc" -eq 3 ] || ok=0
has "$TMP/own.err" "did not send" && ok=0
has "$TMP/own.err" "rank 1 failed first (exit code 3)" || ok=0
record "fsdp-run's own SIGKILL after the grace period is not explained as another's (rc=$rc)" "$ok" "$TMP/own.err"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
