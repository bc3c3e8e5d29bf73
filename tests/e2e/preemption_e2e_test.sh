#!/usr/bin/env bash
# Preemption of fsdp-train (apps/fsdp-train/preemption.h): SIGTERM and SIGINT stop every rank after
# the step in flight, a checkpoint is saved to --save-dir, the exit status is 128 + signal, and the
# resumed run continues the uninterrupted loss curve bit for bit.
#  - SIGTERM to fsdp-run: forwarded to both ranks, which save within the grace period; exit 143;
#    --resume latest then reaches the uninterrupted run's losses and final checkpoint exactly;
#  - SIGINT to one rank only (no launcher): the other rank, which got no signal, agrees at the step
#    boundary; both save one checkpoint and exit 130;
#  - a second SIGTERM while the stop's checkpoint is being saved: exit 143 at once, the previous
#    checkpoint intact (same bytes, still `latest`, verifies), nothing new committed;
#  - one process without --save-dir: exit 143 after the step, saying nothing was saved.
# Prints "time: ..." lines (signal to exit, signal to the first resumed step) for docs/NOTES.md.
# Usage: FSDP_RUN=... FSDP_TRAIN=... FSDP_CKPT=... tests/e2e/preemption_e2e_test.sh   (ctest sets them)
set -u

HERE=$(dirname "${BASH_SOURCE[0]}")
. "$HERE/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN FSDP_TRAIN_TEST FSDP_CKPT
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
TRAIN_TEST=$FSDP_TRAIN_TEST  # fsdp-train with the FSDP_TRAIN_TEST_* hooks (tests only)
CKPT=$FSDP_CKPT
scratch_dir preempt-e2e  # TMP, also the marker in every command line started here

# The schedule is constant after warmup, so a run's first K losses do not depend on --steps: a run
# with --steps 100000 stopped at step K is compared with an uninterrupted run of K + 3 steps.
TINY=(--set model.vocab_size=64 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set data.seq_len=16 --set data.batch_size_per_rank=4 --set train.eval_every=0 --set train.log_every=1
      --set optim.warmup_steps=2 --set optim.schedule=constant --set fsdp.timeout_s=30)

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

lines() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }

# wait_for_lines FILE N [SECONDS]: until FILE has N lines (default at most 60 s).
wait_for_lines() {
  local i
  for i in $(seq $(( ${3:-60} * 20 ))); do
    [ "$(lines "$1")" -ge "$2" ] && return 0
    sleep 0.05
  done
  return 1
}

# wait_exit PID SECONDS: until PID is gone (SIGKILLed after SECONDS); leaves its status in RC.
wait_exit() {
  local i
  for i in $(seq $(( $2 * 20 ))); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.05
  done
  kill -0 "$1" 2>/dev/null && kill -KILL "$1"
  wait "$1"
  RC=$?
}

# The step the stopped run says it stopped at ("stopped by SIG at step K").
stopped_step() { sed -n 's/.*stopped by SIG[A-Z]* at step \([0-9]*\).*/\1/p' "$1" | head -1; }

# two_ranks DIR ARGS...: ranks 0 and 1 of fsdp-train started by hand (no launcher), rank 0 holding
# the master port; leaves their pids in P0 and P1, output in DIR/r{0,1}.{out,err}.
# A shell starts background commands with SIGINT ignored, which fsdp-train (like fsdp-run) keeps
# ignoring: the ranks here get it back (env --default-signal), as a rank under a launcher has it.
two_ranks() {
  local dir=$1
  shift
  RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
    hold_port_and_exec "$dir/port" env --default-signal=INT "${PROGRAM:-$TRAIN}" "$@" >"$dir/r0.out" 2>"$dir/r0.err" </dev/null &
  P0=$!
  wait_for_file "$dir/port"
  RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(cat "$dir/port") \
    env --default-signal=INT "${PROGRAM:-$TRAIN}" "$@" >"$dir/r1.out" 2>"$dir/r1.err" </dev/null &
  P1=$!
}

# ---- SIGTERM to fsdp-run, then --resume latest -------------------------------------------------
D=$TMP/term
mkdir -p "$D"
"$RUN" --nproc-per-node 2 --grace-s 30 -- "$TRAIN" "${TINY[@]}" --steps 100000 --save-dir "$D/ckpt" \
  --metrics "$D/m.jsonl" >"$D/out" 2>"$D/err" </dev/null &
launcher=$!
ok=0
if wait_for_lines "$D/m.jsonl" 3; then
  t0=$(now_ms)
  kill -TERM "$launcher"
  wait_exit "$launcher" 40
  t_exit=$(( $(now_ms) - t0 ))
  K=$(stopped_step "$D/out")
  # Resumed at once, as a scheduler would requeue the job.
  "$RUN" --nproc-per-node 2 -- "$TRAIN" "${TINY[@]}" --steps $((K + 3)) --save-dir "$D/ckpt" --resume latest \
    --metrics "$D/m.jsonl" >"$D/resume.out" 2>"$D/resume.err" </dev/null &
  resumed=$!
  wait_for_lines "$D/m.jsonl" $((K + 1))
  t_resumed=$(( $(now_ms) - t0 ))
  wait "$resumed"
  rc_resume=$?
  echo "time: SIGTERM to fsdp-run -> exit $RC after ${t_exit} ms (stopped at step $K, checkpoint saved);" \
    "SIGTERM -> first resumed step done after ${t_resumed} ms"
  "$RUN" --nproc-per-node 2 -- "$TRAIN" "${TINY[@]}" --steps $((K + 3)) --save-dir "$D/ref" \
    --metrics "$D/ref.jsonl" >"$D/ref.out" 2>"$D/ref.err" </dev/null
  rc_ref=$?
  ok=1
  [ "$RC" -eq 143 ] || ok=0
  [ -n "$K" ] && [ -f "$D/ckpt/step-$(printf %08d "$K")/train_state.json" ] || ok=0
  grep -q "fsdp-run: stopped by SIGTERM" "$D/err" || ok=0
  [ "$rc_resume" -eq 0 ] && [ "$rc_ref" -eq 0 ] || ok=0
  grep -q "resumed from .*step-$(printf %08d "$K") at step $K" "$D/resume.out" || ok=0
  python3 "$HERE/support/same_losses.py" "$D/ref.jsonl" "$D/m.jsonl" >"$D/same" 2>&1 || ok=0
  "$CKPT" diff "$D/ref" "$D/ckpt" >"$D/diff" 2>&1 || ok=0
fi
record "SIGTERM to fsdp-run: both ranks stop after the step, save, exit 143; the resumed run equals the uninterrupted one bit for bit" \
  $ok "$D/err" "$D/out" "$D/resume.err" "$D/same" "$D/diff"

# ---- SIGINT to one rank only, no launcher ---------------------------------------------------------
D=$TMP/int
mkdir -p "$D"
two_ranks "$D" "${TINY[@]}" --steps 100000 --save-dir "$D/ckpt" --metrics "$D/m.jsonl"
ok=0
if wait_for_lines "$D/m.jsonl" 3; then
  t0=$(now_ms)
  kill -INT "$P1"
  wait_exit "$P1" 30
  rc1=$RC
  wait_exit "$P0" 30
  rc0=$RC
  t_exit=$(( $(now_ms) - t0 ))
  K=$(stopped_step "$D/r0.out")
  echo "time: SIGINT to rank 1 only -> both ranks exit ($rc0, $rc1) after ${t_exit} ms, stopped at step $K"
  ok=1
  [ "$rc0" -eq 130 ] && [ "$rc1" -eq 130 ] || ok=0
  grep -q "fsdp-train: SIGINT: stopping after step $K" "$D/r0.err" || ok=0
  [ -n "$K" ] && [ "$(cat "$D/ckpt/latest" 2>/dev/null)" = "step-$(printf %08d "$K")" ] || ok=0
  "$CKPT" verify "$D/ckpt" >"$D/verify" 2>&1 || ok=0
fi
record "SIGINT to rank 1 only: rank 0 (no signal) agrees at the step boundary; both save and exit 130" \
  $ok "$D/r0.err" "$D/r1.err" "$D/verify"

# ---- a second SIGTERM during the save -------------------------------------------------------------
D=$TMP/second
mkdir -p "$D"
"$RUN" --nproc-per-node 2 -- "$TRAIN" "${TINY[@]}" --steps 2 --save-dir "$D/ckpt" >"$D/first.out" 2>&1 </dev/null
PROGRAM=$TRAIN_TEST FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S=60 two_ranks "$D" "${TINY[@]}" --steps 100000 --save-dir "$D/ckpt" \
  --resume latest --metrics "$D/m.jsonl"
ok=0
if wait_for_lines "$D/m.jsonl" 2 && [ "$(cat "$D/ckpt/latest")" = step-00000002 ]; then
  before=$(cd "$D/ckpt/step-00000002" && sha256sum ./* | sha256sum)
  kill -TERM "$P0" "$P1"
  # The stop's save is under way once the hook pauses it before the commit.
  for i in $(seq 600); do grep -q "test hook: pausing" "$D/r0.err" && break; sleep 0.05; done
  t0=$(now_ms)
  kill -TERM "$P0" "$P1"
  wait_exit "$P0" 10
  rc0=$RC
  wait_exit "$P1" 10
  rc1=$RC
  t_exit=$(( $(now_ms) - t0 ))
  echo "time: second SIGTERM during the save -> both ranks exit ($rc0, $rc1) after ${t_exit} ms"
  ok=1
  grep -q "test hook: pausing" "$D/r0.err" || ok=0
  [ "$rc0" -eq 143 ] && [ "$rc1" -eq 143 ] || ok=0
  [ "$t_exit" -lt 5000 ] || ok=0
  grep -q "second SIGTERM: exiting now" "$D/r0.err" || ok=0
  [ "$(cat "$D/ckpt/latest")" = step-00000002 ] || ok=0
  [ "$(cd "$D/ckpt/step-00000002" && sha256sum ./* | sha256sum)" = "$before" ] || ok=0
  [ "$(find "$D/ckpt" -name train_state.json | wc -l)" -eq 1 ] || ok=0
  "$CKPT" verify "$D/ckpt" >"$D/verify" 2>&1 || ok=0
fi
record "second SIGTERM during the stop's save: exit 143 at once, the previous checkpoint intact and still latest" \
  $ok "$D/r0.err" "$D/r1.err" "$D/verify"

# ---- one process, no --save-dir ------------------------------------------------------------------
D=$TMP/nosave
mkdir -p "$D"
"$TRAIN" "${TINY[@]}" --steps 100000 --metrics "$D/m.jsonl" >"$D/out" 2>"$D/err" </dev/null &
pid=$!
ok=0
if wait_for_lines "$D/m.jsonl" 2; then
  kill -TERM "$pid"
  wait_exit "$pid" 30
  ok=1
  [ "$RC" -eq 143 ] || ok=0
  grep -q "stopping after step [0-9]* (no --save-dir: nothing is saved)" "$D/err" || ok=0
  grep -q "stopped by SIGTERM at step" "$D/out" || ok=0
fi
record "one process without --save-dir: SIGTERM stops it after the step with status 143" $ok "$D/err" "$D/out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
