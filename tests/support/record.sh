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
