# Shared by the shell tests (train_e2e, fsdp_ckpt, faults_e2e, offload_e2e): source it, call
# `record NAME OK [DETAIL-FILE...]` per check ($passed and $failed hold the counts) and
# `require_programs FSDP_TRAIN ...` for the programs ctest passes by path.
passed=0
failed=0

record() {  # record NAME OK [DETAIL-FILE...]: OK=1 passes; a failure shows each file's last lines
  local name=$1 ok=$2
  shift 2
  if [ "$ok" = 1 ]; then
    echo "PASS: $name"
    passed=$((passed + 1))
  else
    echo "FAIL: $name"
    local f
    for f in "$@"; do [ -f "$f" ] && tail -n 15 "$f" | sed 's/^/    | /'; done
    failed=$((failed + 1))
  fi
}

require_executables() {  # require_executables PATH...: exit 2 naming the first that is not one
  local exe
  for exe in "$@"; do
    if [ ! -x "$exe" ]; then
      echo "not an executable: $exe" >&2
      exit 2
    fi
  done
}

# require_programs VAR...: each $VAR (FSDP_RUN, FSDP_TRAIN, FSDP_CKPT, which ctest sets to the
# targets' files) names an executable; exit 2 naming the first that does not.
require_programs() {
  local var
  for var in "$@"; do
    if [ -z "${!var:-}" ]; then
      echo "$var is not set (the program's path, e.g. $var=build/bin/...; ctest sets it)" >&2
      exit 2
    fi
    require_executables "${!var}"
  done
}

# hold_port_and_exec PORTFILE CMD ARGS...: binds a listening socket on 127.0.0.1 to a port the
# kernel chooses, writes the port to PORTFILE, then becomes CMD (same pid) with MASTER_PORT and
# FSDP_MASTER_LISTEN_FD set, so rank 0 started by hand hosts its store on a port that no other
# process could take between its choice and its use (what fsdp-run does for its ranks). It execs:
# run it in the background (`hold_port_and_exec F CMD... &`) and $! is CMD's pid.
hold_port_and_exec() {
  exec python3 -c '
import os, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1024)
os.set_inheritable(s.fileno(), True)
port = str(s.getsockname()[1])
os.environ["MASTER_PORT"] = port
os.environ["FSDP_MASTER_LISTEN_FD"] = str(s.fileno())
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(port)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
os.execvp(sys.argv[2], sys.argv[2:])
' "$@"
}

# hold_bound_port PORTFILE: in the background, keeps a port bound and not listening (connecting to
# it is refused, and nobody else can take it) until killed; writes the port to PORTFILE.
hold_bound_port() {
  python3 -c '
import os, signal, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(s.getsockname()[1]))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
signal.pause()
' "$1" &
}

# wait_for_file FILE [SECONDS]: until FILE exists (default 30 s); status 1 if it never appears.
wait_for_file() {
  local i
  for i in $(seq $(( ${2:-30} * 10 ))); do
    [ -e "$1" ] && return 0
    sleep 0.1
  done
  return 1
}

# scratch_dir NAME: makes TMP, a fresh folder /tmp/fsdp-NAME.XXXXXX whose path also marks every
# command line the test starts with it; on exit, every process so marked is killed and TMP removed.
scratch_dir() {
  TMP=$(mktemp -d "/tmp/fsdp-$1.XXXXXX")
  trap 'remove_scratch_dir "$TMP"' EXIT
}
remove_scratch_dir() {
  local pids
  pids=$(pgrep -f -- "$1")
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  rm -rf "$1"
}
