#!/usr/bin/env bash
# Self-checking tests of fsdp-run, the local launcher (apps/fsdp-run/): the torchrun environment,
# "[rank K] " output forwarding, first-failure teardown, the SIGTERM grace period, usage errors,
# exec failures, --timeout-s and signal forwarding. Every case that can leave processes behind
# checks that none survive, using sleep durations that embed this script's pid as a marker.
# Usage: tests/e2e/launcher_test.sh path/to/fsdp-run        (about 6 s; prints "N passed, M failed")
set -u

BIN=${1:?usage: $0 path/to/fsdp-run}
if [ ! -x "$BIN" ]; then
  echo "not an executable: $BIN" >&2
  exit 2
fi
TMP=$(mktemp -d)
# The cases below run with the thread count fixed; case_thread_default clears it.
export OMP_NUM_THREADS=1
TAG=$$  # unique per run, so marker sleeps never match another run's processes
MARKERS="sleep 6[0-9]\\.$TAG"
passed=0
failed=0
reasons=()

cleanup() {
  # Only ever the marker sleeps this run started, by pid, in case a failing case left some.
  local pids
  pids=$(pgrep -f -- "$MARKERS")
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# launch ARGS...: runs fsdp-run, leaving RC, ELAPSED_MS and $TMP/out, $TMP/err.
launch() {
  local start
  start=$(now_ms)
  # The outer timeout only guards against a hung launcher; no passing case comes near it.
  timeout -k 2 20 "$BIN" "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
  RC=$?
  ELAPSED_MS=$(( $(now_ms) - start ))
}

# expect DESCRIPTION SHELL-CONDITION: records DESCRIPTION as a failure reason unless it holds.
expect() {
  if ! eval "$2"; then reasons+=("$1"); fi
}

# No process whose command line carries MARKER may remain. A SIGKILLed process can take a moment
# to disappear from /proc, so this waits up to 2 s; a real leftover sleeps for a minute.
no_leftover() {
  local i
  for i in $(seq 20); do
    pgrep -f -- "$1" >/dev/null || return 0
    sleep 0.1
  done
  return 1
}

finish_case() {
  if [ ${#reasons[@]} -eq 0 ]; then
    echo "PASS: $1"
    passed=$((passed + 1))
  else
    echo "FAIL: $1"
    printf '  - %s\n' "${reasons[@]}"
    echo "  rc=$RC elapsed=${ELAPSED_MS}ms; stdout, stderr (first 10 lines):"
    head -n 10 "$TMP/out" | sed 's/^/    | /'
    head -n 10 "$TMP/err" | sed 's/^/    ! /'
    failed=$((failed + 1))
  fi
  reasons=()
}

# (a) Two ranks, each printing its torchrun variables; lines carry the rank prefix, stderr stays
# on stderr, an unterminated last line is still forwarded, both ranks see one MASTER_PORT.
case_success_two_ranks() {
  launch --nproc-per-node 2 -- bash -c \
    'echo "rank=$RANK world=$WORLD_SIZE port=$MASTER_PORT local=$LOCAL_RANK"
     echo "to-stderr rank=$RANK" >&2
     printf "tail-without-newline"'
  expect "exit status 0" '[ "$RC" -eq 0 ]'
  expect "rank 0 line" "grep -Eq '^\\[rank 0\\] rank=0 world=2 port=[0-9]+ local=0\$' '$TMP/out'"
  expect "rank 1 line" "grep -Eq '^\\[rank 1\\] rank=1 world=2 port=[0-9]+ local=1\$' '$TMP/out'"
  local ports
  ports=$(sed -n 's/^\[rank [01]\] rank=[01] world=2 port=\([0-9]*\) .*/\1/p' "$TMP/out" | sort -u)
  expect "one MASTER_PORT shared by both ranks (got '$ports')" \
    '[ -n "$ports" ] && [ "$(echo "$ports" | wc -l)" -eq 1 ]'
  expect "stderr lines prefixed on stderr" \
    "grep -q '^\\[rank 0\\] to-stderr rank=0\$' '$TMP/err' && grep -q '^\\[rank 1\\] to-stderr rank=1\$' '$TMP/err'"
  expect "no stderr line on stdout" "! grep -q to-stderr '$TMP/out'"
  expect "unterminated last line flushed" \
    "[ \"\$(grep -c '^\\[rank [01]\\] tail-without-newline\$' '$TMP/out')\" -eq 2 ]"
  expect "exactly 4 stdout lines" "[ \"\$(wc -l <'$TMP/out')\" -eq 4 ]"
  finish_case "success with 2 ranks, prefixed output, shared MASTER_PORT"
}

# The rest of the torchrun environment: explicit address/port, stale RANK overridden, the
# parent's other variables kept.
case_environment() {
  RANK=99 FSDP_LAUNCHER_TEST_VAR=kept launch --nproc-per-node 3 --master-addr 127.0.0.2 \
    --master-port 29555 -- bash -c \
    'echo "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $ROLE_RANK $ROLE_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $TORCHELASTIC_RUN_ID $FSDP_LAUNCHER_TEST_VAR"'
  expect "exit status 0" '[ "$RC" -eq 0 ]'
  local r
  for r in 0 1 2; do
    expect "rank $r environment" \
      "grep -qx '\\[rank $r\\] $r $r 3 3 0 $r 3 127.0.0.2 29555 fsdp-run kept' '$TMP/out'"
  done
  finish_case "torchrun environment, explicit master address and port"
}

# (b) Rank 1 exits 3 while rank 0 sleeps: the launcher stops at once, passes 3 through, names
# rank 1, and the sleep is gone.
case_first_failure() {
  local marker="sleep 61.$TAG"
  launch --nproc-per-node 2 -- bash -c "if [ \"\$RANK\" = 1 ]; then exit 3; fi; $marker; echo not-reached"
  expect "exit status 3 (rank 1's code)" '[ "$RC" -eq 3 ]'
  expect "stopped within 5 s" '[ "$ELAPSED_MS" -lt 5000 ]'
  expect "stderr names rank 1" "grep -q 'fsdp-run: rank 1 failed first (exit code 3)' '$TMP/err'"
  expect "rank 0 did not finish" "! grep -q not-reached '$TMP/out'"
  expect "no '$marker' left" "no_leftover '$marker'"
  finish_case "first failure stops the other ranks"
}

# (c) A rank that ignores SIGTERM is SIGKILLed once the 1 s grace period is over, not before.
case_ignores_sigterm() {
  local marker="sleep 62.$TAG"
  launch --nproc-per-node 2 --grace-s 1 -- bash -c \
    "trap '' TERM; if [ \"\$RANK\" = 1 ]; then sleep 0.3; exit 5; fi; $marker"
  expect "exit status 5 (rank 1's code)" '[ "$RC" -eq 5 ]'
  expect "waited the grace period (>= 1.2 s)" '[ "$ELAPSED_MS" -ge 1200 ]'
  expect "then killed (< 4 s)" '[ "$ELAPSED_MS" -lt 4000 ]'
  expect "stderr names rank 1" "grep -q 'fsdp-run: rank 1 failed first (exit code 5)' '$TMP/err'"
  expect "no '$marker' left" "no_leftover '$marker'"
  finish_case "SIGTERM-ignoring rank is SIGKILLed after --grace-s"
}

# (d) Usage errors exit 2 with a message naming the problem, and start nothing.
case_bad_usage() {
  launch --nproc-per-node 2 touch "$TMP/started"
  expect "no '--': exit 2" '[ "$RC" -eq 2 ]'
  expect "no '--': message names '--'" "grep -q \"'--'\" '$TMP/err'"
  expect "no '--': nothing started" "[ ! -e '$TMP/started' ]"
  launch --nproc-per-node 0 -- true
  expect "N=0: exit 2" '[ "$RC" -eq 2 ]'
  expect "N=0: message names flag and value" "grep -q -- \"--nproc-per-node must be .*got '0'\" '$TMP/err'"
  launch --nproc-per-node abc -- true
  expect "N=abc: exit 2" '[ "$RC" -eq 2 ]'
  expect "N=abc: message names flag and value" "grep -q -- \"--nproc-per-node must be .*got 'abc'\" '$TMP/err'"
  launch --nproc-per-node 2 --bogus 1 -- true
  expect "unknown flag: exit 2" '[ "$RC" -eq 2 ]'
  expect "unknown flag: message names it" "grep -q -- \"unknown option '--bogus'\" '$TMP/err'"
  launch --nproc-per-node 2 --
  expect "no command: exit 2" '[ "$RC" -eq 2 ]'
  expect "no command: message says so" "grep -q 'missing command' '$TMP/err'"
  launch -- true
  expect "no --nproc-per-node: exit 2" '[ "$RC" -eq 2 ]'
  expect "no --nproc-per-node: message names it" "grep -q -- '--nproc-per-node is required' '$TMP/err'"
  launch --help
  expect "--help: exit 0 with usage" "[ \"\$RC\" -eq 0 ] && grep -q '^usage: fsdp-run' '$TMP/out'"
  finish_case "bad usage is rejected with a message naming the problem"
}

# (e) A command that does not exist: each rank reports why, the launcher names the rank.
case_missing_command() {
  launch --nproc-per-node 2 -- "fsdp-no-such-command-$TAG" --flag
  expect "exit status 1" '[ "$RC" -eq 1 ]'
  expect "stderr names the failing rank" \
    "grep -Eq 'fsdp-run: rank [01] failed first \\(exit code 127\\)' '$TMP/err'"
  expect "the rank says why" \
    "grep -q '^\\[rank [01]\\] fsdp-run: cannot execute fsdp-no-such-command-$TAG: ' '$TMP/err'"
  finish_case "command not found is a failure of a named rank"
}

# A rank killed by a signal is reported by signal name and maps to exit status 1.
case_rank_killed_by_signal() {
  launch --nproc-per-node 2 -- bash -c 'if [ "$RANK" = 0 ]; then kill -KILL $$; fi; sleep 0.5'
  expect "exit status 1" '[ "$RC" -eq 1 ]'
  expect "signal named" "grep -q 'fsdp-run: rank 0 failed first (killed by signal SIGKILL)' '$TMP/err'"
  finish_case "rank killed by a signal"
}

# (f) --timeout-s 2 on a job that sleeps: exit 124 after about 2 s, nothing left.
case_timeout() {
  local marker="sleep 63.$TAG"
  launch --nproc-per-node 2 --timeout-s 2 --grace-s 1 -- bash -c "$marker"
  expect "exit status 124" '[ "$RC" -eq 124 ]'
  expect "ran about 2 s (1.9..4.5 s)" '[ "$ELAPSED_MS" -ge 1900 ] && [ "$ELAPSED_MS" -lt 4500 ]'
  expect "timeout reported" "grep -q 'fsdp-run: timed out after 2 s' '$TMP/err'"
  expect "no '$marker' left" "no_leftover '$marker'"
  finish_case "--timeout-s stops the job with 124"
}

# signal_when_ready SIG PID START_MS: once both ranks have printed "ready" to $TMP/out (their traps
# are installed), sends SIG to the launcher PID and waits for it: RC, and ELAPSED_MS since START_MS.
signal_when_ready() {
  local sig=$1 pid=$2 start=$3 i
  for i in $(seq 50); do
    [ "$(grep -c ready "$TMP/out")" -eq 2 ] && break
    sleep 0.1
  done
  kill -"$sig" "$pid"
  wait "$pid"
  RC=$?
  ELAPSED_MS=$(( $(now_ms) - start ))
}

# SIGTERM sent to the launcher reaches every rank (which can act on it), then exit 143.
case_forwards_sigterm() {
  local marker="sleep 64.$TAG" start
  start=$(now_ms)
  "$BIN" --nproc-per-node 2 -- bash -c \
    "trap 'echo rank \$RANK got TERM; exit 0' TERM; echo ready; $marker & wait" \
    >"$TMP/out" 2>"$TMP/err" </dev/null &
  signal_when_ready TERM $! "$start"
  expect "exit status 143" '[ "$RC" -eq 143 ]'
  expect "rank 0 got TERM" "grep -qx '\\[rank 0\\] rank 0 got TERM' '$TMP/out'"
  expect "rank 1 got TERM" "grep -qx '\\[rank 1\\] rank 1 got TERM' '$TMP/out'"
  expect "stopped within 5 s" '[ "$ELAPSED_MS" -lt 5000 ]'
  expect "no '$marker' left" "no_leftover '$marker'"
  finish_case "SIGTERM to the launcher is forwarded, exit 143"
}

# SIGINT (Ctrl-C) is forwarded too, and a rank that needs time to finish (a checkpoint save) gets
# the grace period: its late output arrives and it is not killed; the launcher exits 130.
case_forwards_sigint_and_waits_the_grace_period() {
  local marker="sleep 65.$TAG" start
  start=$(now_ms)
  # Started in the background, it would inherit an ignored SIGINT and keep ignoring it, as shells do.
  env --default-signal=INT "$BIN" --nproc-per-node 2 --grace-s 10 -- bash -c \
    "trap 'sleep 1.5; echo rank \$RANK saved; exit 130' INT; echo ready; $marker" \
    >"$TMP/out" 2>"$TMP/err" </dev/null &
  signal_when_ready INT $! "$start"
  expect "exit status 130" '[ "$RC" -eq 130 ]'
  expect "rank 0 finished its save" "grep -qx '\\[rank 0\\] rank 0 saved' '$TMP/out'"
  expect "rank 1 finished its save" "grep -qx '\\[rank 1\\] rank 1 saved' '$TMP/out'"
  expect "stderr says SIGINT" "grep -q 'stopped by SIGINT' '$TMP/err'"
  expect "no '$marker' left" "no_leftover '$marker'"
  finish_case "SIGINT to the launcher is forwarded, ranks finish within --grace-s, exit 130"
}

# The master port is held, not picked (Note [The master port is held, not picked]): rank 0 gets
# FSDP_MASTER_LISTEN_FD, a listening socket bound to MASTER_PORT; the other ranks get neither the
# variable nor the socket; with --master-port there is none.
case_master_socket_goes_to_rank_zero() {
  launch --nproc-per-node 2 -- python3 -c '
import os, socket
fd = os.environ.get("FSDP_MASTER_LISTEN_FD")
if fd is None:
    print(os.environ["RANK"], "none")
else:
    s = socket.socket(fileno=int(fd))
    listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    print(os.environ["RANK"], s.getsockname()[1] == int(os.environ["MASTER_PORT"]), listening)
'
  expect "exit status 0" '[ "$RC" -eq 0 ]'
  expect "rank 0 holds a listening socket on MASTER_PORT" "grep -qx '\\[rank 0\\] 0 True 1' '$TMP/out'"
  expect "rank 1 has none" "grep -qx '\\[rank 1\\] 1 none' '$TMP/out'"
  FSDP_MASTER_LISTEN_FD=5 launch --nproc-per-node 1 --master-port 29556 -- bash -c 'echo "fd=${FSDP_MASTER_LISTEN_FD:-unset}"'
  expect "none with --master-port" "grep -qx '\\[rank 0\\] fd=unset' '$TMP/out'"
  finish_case "rank 0 inherits the held master socket, the others do not"
}

# Lots of output on both streams from both ranks: no deadlock, no line lost or reordered.
case_large_output() {
  launch --nproc-per-node 2 --timeout-s 20 -- bash -c 'seq 1 30000; seq 1 30000 >&2'
  expect "exit status 0" '[ "$RC" -eq 0 ]'
  local r f
  for r in 0 1; do
    for f in out err; do
      expect "rank $r $f: 30000 lines in order" \
        "sed -n 's/^\\[rank $r\\] //p' '$TMP/$f' | cmp -s - <(seq 1 30000)"
    done
  done
  expect "nothing unprefixed" "! grep -qv '^\\[rank [01]\\] [0-9]*\$' '$TMP/out' '$TMP/err'"
  finish_case "large output is forwarded completely"
}

# Note [Threads per rank]: unless OMP_NUM_THREADS is set, each rank gets the launcher's cores
# divided among the ranks (at least 1), and fsdp-run says so; a value the user set is kept.
case_thread_default() {
  local cores expected
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc itself honours OMP_NUM_THREADS
  for n in 1 2 3; do
    expected=$(( cores / n )); [ "$expected" -lt 1 ] && expected=1
    env -u OMP_NUM_THREADS "$BIN" --nproc-per-node $n -- bash -c 'echo "threads=$OMP_NUM_THREADS"' \
      >"$TMP/out" 2>"$TMP/err" </dev/null
    RC=$?
    expect "exit status 0 with $n rank(s)" '[ "$RC" -eq 0 ]'
    expect "every one of $n rank(s) gets $expected thread(s)" \
      "[ \"\$(grep -c '^\\[rank [0-9]*\\] threads=$expected\$' '$TMP/out')\" -eq $n ]"
    expect "the chosen value is printed ($n rank(s))" \
      "grep -q '^fsdp-run: OMP_NUM_THREADS=$expected for each of $n rank(s)' '$TMP/err'"
  done
  OMP_NUM_THREADS=3 launch --nproc-per-node 2 -- bash -c 'echo "threads=$OMP_NUM_THREADS"'
  expect "a value the user set is kept" "[ \"\$(grep -c '^\\[rank [01]\\] threads=3\$' '$TMP/out')\" -eq 2 ]"
  expect "nothing printed when set" "! grep -q OMP_NUM_THREADS '$TMP/err'"
  finish_case "intra-op threads per rank: cores / ranks unless OMP_NUM_THREADS is set"
}

case_success_two_ranks
case_environment
case_thread_default
case_first_failure
case_ignores_sigterm
case_bad_usage
case_missing_command
case_rank_killed_by_signal
case_timeout
case_forwards_sigterm
case_forwards_sigint_and_waits_the_grace_period
case_master_socket_goes_to_rank_zero
case_large_output

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
