#!/usr/bin/env bash
# Peer faults and bad input through the real programs, fsdp-train and fsdp-run:
#  - 2 ranks of fsdp-train started torchrun-style (no launcher) with fsdp.timeout_s=3: one rank
#    SIGKILLed or SIGSTOPped mid-training; the survivor must exit non-zero within timeout + 10 s
#    naming the collective (and the peer when known);
#  - the same faults under fsdp-run: it names the first failing rank, exits non-zero, and leaves
#    no process behind;
#  - bad environment, bad flags and bad config values: a clear error naming the culprit, exit
#    status 1 or 2 and never a signal;
#  - fsdp.debug.check_collectives=true trains exactly as without it.
# Prints "time-to-exit: ..." lines for docs/NOTES.md.
# Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train tests/e2e/faults_e2e_test.sh
#        (ctest sets both; about 60 s on 2 cores; "N passed, M failed")
set -u

. "$(dirname "${BASH_SOURCE[0]}")/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN FSDP_TRAIN_TEST
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
TRAIN_TEST=$FSDP_TRAIN_TEST  # fsdp-train with the FSDP_TRAIN_TEST_* hooks (tests only)
scratch_dir faults-e2e  # TMP, also the marker in every command line started here
TIMEOUT_S=3

TINY=(--set model.vocab_size=64 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set data.seq_len=16 --set data.batch_size_per_rank=4 --set train.eval_every=0 --set train.log_every=1
      --set optim.warmup_steps=2)

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# No process started by this script may remain (SIGKILLed ones can take a moment to go).
no_leftover() {
  local i
  for i in $(seq 30); do
    pgrep -f -- "$TMP" >/dev/null || return 0
    sleep 0.1
  done
  pgrep -af -- "$TMP" >&2
  return 1
}

# wait_for_steps FILE N: until FILE has N metrics lines (at most 60 s).
wait_for_steps() {
  local i
  for i in $(seq 600); do
    [ -f "$1" ] && [ "$(wc -l <"$1")" -ge "$2" ] && return 0
    sleep 0.1
  done
  return 1
}

# pid_of_rank RANK: the fsdp-train process of this script with that RANK in its environment.
pid_of_rank() {
  local p
  for p in $(pgrep -f -- "$TRAIN.*$TMP"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1"; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

# A stopped peer is noticed by whichever collective the survivor is in when the timeout runs out,
# each of which is correct: a ring transfer (Gloo: "Timed out waiting ...", or our own "did not
# complete within ..."), one of Gloo's own collectives such as clipping's all_reduce ("Operation
# timed out!"), or the communicator's bound on a wait ("did not finish within").
TIMED_OUT='re:timed out|did not complete within|did not finish within'

# has_needle NEEDLE FILE: FILE contains NEEDLE, case aside ("re:REGEX": an extended regex).
has_needle() {
  case $1 in
    re:*) grep -qiE -- "${1#re:}" "$2" ;;
    *) grep -qiF -- "$1" "$2" ;;
  esac
}

# ---- survivors of a dead or stopped peer, without a launcher ------------------------------------
# direct_fault NAME SIGNAL NEEDLE...: ranks 0 and 1 started by hand; rank 1 gets SIGNAL after 3
# steps; rank 0 must exit 1 within timeout + 10 s with every NEEDLE on stderr (has_needle).
direct_fault() {
  local name=$1 sig=$2
  shift 2
  local dir="$TMP/$name"
  mkdir -p "$dir"
  local pids=() args=("${TINY[@]}" --steps 100000 --set fsdp.timeout_s=$TIMEOUT_S --metrics "$dir/m.jsonl")
  RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
    hold_port_and_exec "$dir/port" "$TRAIN" "${args[@]}" >"$dir/r0.out" 2>"$dir/r0.err" </dev/null &
  pids+=($!)
  wait_for_file "$dir/port"
  RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(cat "$dir/port") \
    "$TRAIN" "${args[@]}" >"$dir/r1.out" 2>"$dir/r1.err" </dev/null &
  pids+=($!)
  local ok=0 rc=-1 elapsed=-1
  if wait_for_steps "$dir/m.jsonl" 3; then
    kill -"$sig" "${pids[1]}"
    local t0
    t0=$(now_ms)
    local i
    for i in $(seq $(( (TIMEOUT_S + 15) * 10 ))); do
      kill -0 "${pids[0]}" 2>/dev/null || break
      sleep 0.1
    done
    elapsed=$(( $(now_ms) - t0 ))
    if kill -0 "${pids[0]}" 2>/dev/null; then
      kill -KILL "${pids[0]}"
    fi
    wait "${pids[0]}"
    rc=$?
    ok=1
    [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ] || ok=0
    [ "$elapsed" -le $(( (TIMEOUT_S + 10) * 1000 )) ] || ok=0
    local n
    for n in "$@"; do has_needle "$n" "$dir/r0.err" || { ok=0; echo "  missing: $n" >>"$dir/r0.err"; }; done
  fi
  kill -KILL "${pids[1]}" 2>/dev/null
  wait "${pids[1]}" 2>/dev/null
  echo "time-to-exit: fsdp-train rank 1 $sig, no launcher (timeout ${TIMEOUT_S} s): rank 0 exit $rc after ${elapsed} ms: $(grep -m1 'error:' "$dir/r0.err")"
  record "fsdp-train: rank 1 $sig'd mid-training, rank 0 exits $rc within timeout + 10 s (${elapsed} ms) naming the collective" \
    $ok "$dir/r0.err" "$dir/r1.err"
}
direct_fault kill KILL "fsdp-train: error: fsdp: " "group 'world'" "peer rank 1"
direct_fault stop STOP "fsdp-train: error: fsdp: " "group 'world'" "$TIMED_OUT"

# ---- the same under fsdp-run ------------------------------------------------------------------------
# launched_fault NAME SIGNAL VICTIM FIRST: rank VICTIM gets SIGNAL after 3 steps; fsdp-run must
# exit non-zero naming rank FIRST as the first failure, and leave nothing behind.
launched_fault() {
  local name=$1 sig=$2 victim=$3 first=$4
  local dir="$TMP/launched-$name"
  mkdir -p "$dir"
  "$RUN" --nproc-per-node 2 --grace-s 2 -- "$TRAIN" "${TINY[@]}" --steps 100000 --set fsdp.timeout_s=$TIMEOUT_S \
    --metrics "$dir/m.jsonl" >"$dir/out" 2>"$dir/err" </dev/null &
  local launcher=$! ok=0 rc=-1 elapsed=-1
  if wait_for_steps "$dir/m.jsonl" 3; then
    local pid t0
    pid=$(pid_of_rank "$victim")
    t0=$(now_ms)
    [ -n "$pid" ] && kill -"$sig" "$pid"
    local i
    for i in $(seq $(( (TIMEOUT_S + 20) * 10 ))); do
      kill -0 "$launcher" 2>/dev/null || break
      sleep 0.1
    done
    elapsed=$(( $(now_ms) - t0 ))
    kill -0 "$launcher" 2>/dev/null && kill -KILL "$launcher"
    wait "$launcher"
    rc=$?
    ok=1
    [ -n "$pid" ] || ok=0
    [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ] || ok=0
    [ "$elapsed" -le $(( (TIMEOUT_S + 10 + 2) * 1000 )) ] || ok=0
    grep -qF "fsdp-run: rank $first failed first" "$dir/err" || ok=0
    no_leftover || ok=0
  fi
  echo "time-to-exit: fsdp-run, rank $victim $sig (timeout ${TIMEOUT_S} s): launcher exit $rc after ${elapsed} ms: $(grep -m1 'failed first' "$dir/err")"
  record "fsdp-run: rank $victim $sig'd, launcher exits $rc in ${elapsed} ms naming rank $first, no process left" \
    $ok "$dir/err"
}
launched_fault kill KILL 1 1
# A stopped rank does not exit: its peer times out in a collective and fails first.
launched_fault stop STOP 1 0
has_needle "$TIMED_OUT" "$TMP/launched-stop/err" && grep -qF "[rank 0] fsdp-train: error: fsdp: " "$TMP/launched-stop/err"
record "fsdp-run: the surviving rank's timeout message is forwarded" $([ $? -eq 0 ] && echo 1 || echo 0) "$TMP/launched-stop/err"

# ---- bad environment, flags and config values ---------------------------------------------------------
# bad NAME TEXT ENV... -- ARGS...: fsdp-train alone with ENV exits 1 or 2 (no signal) printing TEXT.
bad() {
  local name=$1 text=$2
  shift 2
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local t0 rc
  t0=$(now_ms)
  env "${envs[@]}" timeout -k 2 30 "${PROGRAM:-$TRAIN}" "${TINY[@]}" --steps 1 --set fsdp.timeout_s=$TIMEOUT_S \
    --metrics "$TMP/bad.jsonl" "$@" >"$TMP/bad.out" 2>"$TMP/bad.err" </dev/null
  rc=$?
  local elapsed=$(( $(now_ms) - t0 )) ok=0
  if { [ $rc -eq 1 ] || [ $rc -eq 2 ]; } && grep -qF -- "fsdp-train: error:" "$TMP/bad.err" &&
     grep -qF -- "$text" "$TMP/bad.err"; then ok=1; fi
  record "$name: exit $rc in ${elapsed} ms" $ok "$TMP/bad.err"
}
bad "RANK not a number" "RANK" RANK=abc WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 --
bad "WORLD_SIZE zero" "WORLD_SIZE" RANK=0 WORLD_SIZE=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 --
bad "RANK out of range" "RANK" RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 --
bad "MASTER_PORT out of range" "MASTER_PORT" RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=70000 --
bad "MASTER_ADDR missing" "MASTER_ADDR" RANK=1 WORLD_SIZE=2 MASTER_PORT=29999 --
hold_bound_port "$TMP/refusing.port"
refusing=$!
wait_for_file "$TMP/refusing.port"
bad "unreachable store" "could not reach the rendezvous store" RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
  MASTER_PORT=$(cat "$TMP/refusing.port") --
kill "$refusing"
wait "$refusing" 2>/dev/null
bad "FSDP_THREADS zero" "FSDP_THREADS=0" FSDP_THREADS=0 --
bad "timeout zero" "fsdp.timeout_s=0" X=1 -- --set fsdp.timeout_s=0
bad "debug flag not a boolean" 'fsdp.debug.check_collectives="yes": must be true or false' X=1 -- \
  --set fsdp.debug.check_collectives=yes
bad "unknown debug key" "fsdp.debug.check_colectives" X=1 -- --set fsdp.debug.check_colectives=true
bad "steps too large" "train.steps" X=1 -- --set train.steps=1e30
bad "NaN learning rate" "optim.lr" X=1 -- --set optim.lr=NaN
bad "negative batch" "data.batch_size_per_rank=-4" X=1 -- --set data.batch_size_per_rank=-4
bad "model dims that do not divide" "model" X=1 -- --set model.num_attention_heads=5
echo '[1, 2]' >"$TMP/array.json"
bad "config file that is not an object" "array.json" X=1 -- --config "$TMP/array.json"
python3 -c "print('[' * 100000 + ']' * 100000)" >"$TMP/deep.json"
bad "deeply nested config file" "deep.json" X=1 -- --config "$TMP/deep.json"
python3 -c "print('{\"train\": ' + '[' * 100000 + ']' * 100000 + '}')" >"$TMP/deep_value.json"
bad "deeply nested config value (was a stack overflow)" "deep_value.json" X=1 -- --config "$TMP/deep_value.json"
# 100,000 characters: under the kernel's limit on one argument (128 KiB).
bad "deeply nested --set value" "train.steps" X=1 -- --set "train.steps=$(python3 -c "print('[' * 50000 + ']' * 50000)")"
head -c 3000 /dev/urandom >"$TMP/binary.json"
bad "binary config file" "binary.json" X=1 -- --config "$TMP/binary.json"
# Found by fuzz/fuzz_config.cpp: invalid UTF-8 in a value made the error path itself throw.
bad "invalid UTF-8 in a --set value" "optim.betas" X=1 -- --set $'optim.betas=[\xff\xff0.9'
bad "invalid UTF-8 in a model --set value" "model.hidden_size" X=1 -- --set $'model.hidden_size=optim.b\xf4as'
printf '{"data": {"path": "\xff\xfe"}, "optim": {"schedule": "\xc0"}}' >"$TMP/latin1.json"
bad "invalid UTF-8 in a config file" "latin1.json" X=1 -- --config "$TMP/latin1.json"
echo '{"optim": {"lr": 1e999}}' >"$TMP/overflow.json"  # found by fuzz_config: escaped as nlohmann's out_of_range
bad "number overflow in a config file" "overflow.json': not valid JSON" X=1 -- --config "$TMP/overflow.json"
bad "config file that is a directory" "$TMP" X=1 -- --config "$TMP"
bad "missing config file" "nope.json" X=1 -- --config "$TMP/nope.json"
bad "flag value missing" "--set" X=1 -- --set
bad "--set without =" "model.hidden_size" X=1 -- --set model.hidden_size
bad "resume from a missing checkpoint" "$TMP/none/step-00000005" X=1 -- --save-dir "$TMP/none" \
  --resume "$TMP/none/step-00000005"
mkdir -p "$TMP/dangling"
echo step-00000007 >"$TMP/dangling/latest"
bad "--resume latest naming a checkpoint that is gone" "step-00000007" X=1 -- --save-dir "$TMP/dangling" --resume latest
PROGRAM=$TRAIN_TEST bad "bad test hook value" "FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S" FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S=soon --
# The installed fsdp-train reads no test hook: its binary does not even name one.
if grep -qa FSDP_TRAIN_TEST "$TRAIN"; then ok=0; else ok=1; fi
record "fsdp-train reads no FSDP_TRAIN_TEST_* variable (the hooks live in fsdp-train-test)" $ok
bad "FSDP_MASTER_LISTEN_FD not a number" "FSDP_MASTER_LISTEN_FD" RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
  MASTER_PORT=29999 FSDP_MASTER_LISTEN_FD=x --
bad "FSDP_MASTER_LISTEN_FD not a socket on MASTER_PORT" "is not a TCP socket bound to MASTER_PORT=29999" RANK=0 \
  WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 FSDP_MASTER_LISTEN_FD=0 --
bad "TORCHELASTIC_USE_AGENT_STORE not True or False" "TORCHELASTIC_USE_AGENT_STORE" RANK=0 WORLD_SIZE=2 \
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 TORCHELASTIC_USE_AGENT_STORE=1 --

# ---- the collective-order check through the config ----------------------------------------------------
"$RUN" --nproc-per-node 2 -- "$TRAIN" "${TINY[@]}" --steps 4 --metrics "$TMP/plain.jsonl" >"$TMP/plain.out" 2>&1 </dev/null
rc1=$?
"$RUN" --nproc-per-node 2 -- "$TRAIN" "${TINY[@]}" --steps 4 --set fsdp.debug.check_collectives=true \
  --metrics "$TMP/checked.jsonl" >"$TMP/checked.out" 2>&1 </dev/null
rc2=$?
ok=0
if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] &&
   diff <(python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$TMP/plain.jsonl") \
        <(python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$TMP/checked.jsonl") \
        >"$TMP/checked.diff"; then ok=1; fi
record "fsdp.debug.check_collectives=true trains with the same losses" $ok "$TMP/checked.out" "$TMP/checked.diff"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
