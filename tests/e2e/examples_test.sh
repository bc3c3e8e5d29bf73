#!/usr/bin/env bash
# The examples a user copies, run as a user runs them: each on 1 and 2 ranks over the same global
# batch must print the same loss at every step (relative 1e-5); the Sequential example saved at
# step 3 and resumed to step 6 must print the uninterrupted run's losses and eval loss (which reads
# BatchNorm's running statistics, so a resume that lost the buffers shows here); fsdp-ckpt verify
# passes its checkpoint.
# Usage: FSDP_RUN=... FSDP_EXAMPLE_SEQUENTIAL=... FSDP_EXAMPLE_TWO_HEADS=... FSDP_CKPT=... tests/e2e/examples_test.sh
set -u

. "$(dirname "${BASH_SOURCE[0]}")/support/record.sh"
require_programs FSDP_RUN FSDP_EXAMPLE_SEQUENTIAL FSDP_EXAMPLE_TWO_HEADS FSDP_CKPT
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# run NPROC OUT PROGRAM ARGS...: rank 0's "step N loss X" / "eval loss X" lines into OUT.
run() {
  local nproc=$1 out=$2
  shift 2
  timeout -k 5 120 "$FSDP_RUN" --nproc-per-node "$nproc" --timeout-s 100 -- "$@" >"$out.raw" 2>"$out.err" </dev/null
  RC=$?
  grep -o 'step [0-9]* loss .*\|eval loss .*' "$out.raw" >"$out" || true
}

# same A B TOL: the same lines, numbers within relative TOL (0: identical text).
same() {
  python3 - "$@" <<'PY'
import sys
a, b, tol = open(sys.argv[1]).read().split("\n"), open(sys.argv[2]).read().split("\n"), float(sys.argv[3])
a, b = [l for l in a if l], [l for l in b if l]
if len(a) != len(b) or not a:
    sys.exit("%d lines vs %d" % (len(a), len(b)))
for x, y in zip(a, b):
    fx, fy = float(x.split()[-1]), float(y.split()[-1])
    if x.rsplit(" ", 1)[0] != y.rsplit(" ", 1)[0] or abs(fx - fy) > tol * max(abs(fx), 1e-12) or (tol == 0 and x != y):
        sys.exit("%r vs %r" % (x, y))
PY
}

for ex in SEQUENTIAL TWO_HEADS; do
  prog_var=FSDP_EXAMPLE_$ex
  prog=${!prog_var}
  extra=()
  [ "$ex" = SEQUENTIAL ] && extra=(--out "$TMP/$ex.1.ckpt")
  run 1 "$TMP/$ex.1" "$prog" --steps 6 "${extra[@]}"
  ok1=$RC
  [ "$ex" = SEQUENTIAL ] && extra=(--out "$TMP/$ex.2.ckpt")
  run 2 "$TMP/$ex.2" "$prog" --steps 6 "${extra[@]}"
  ok2=$RC
  grep -v eval "$TMP/$ex.1" >"$TMP/$ex.1.train"
  grep -v eval "$TMP/$ex.2" >"$TMP/$ex.2.train"
  if [ $ok1 = 0 ] && [ $ok2 = 0 ] && same "$TMP/$ex.1.train" "$TMP/$ex.2.train" 1e-5 >"$TMP/$ex.cmp" 2>&1 &&
     [ "$(wc -l <"$TMP/$ex.1.train")" = 6 ]; then
    record "$ex: 1 and 2 ranks give the same losses" 1
  else
    record "$ex: 1 and 2 ranks give the same losses" 0 "$TMP/$ex.1.err" "$TMP/$ex.2.err" "$TMP/$ex.cmp" "$TMP/$ex.1" "$TMP/$ex.2"
  fi
done

# Resume: 3 steps, save; then --resume to 6 in fresh processes.
run 2 "$TMP/first" "$FSDP_EXAMPLE_SEQUENTIAL" --steps 3 --out "$TMP/resume"
rc_first=$RC
run 2 "$TMP/second" "$FSDP_EXAMPLE_SEQUENTIAL" --steps 6 --out "$TMP/resume" --resume
rc_second=$RC
grep -v eval "$TMP/first" >"$TMP/resumed"
cat "$TMP/second" >>"$TMP/resumed"
if [ $rc_first = 0 ] && [ $rc_second = 0 ] && same "$TMP/SEQUENTIAL.2" "$TMP/resumed" 0 >"$TMP/resume.cmp" 2>&1; then
  record "SEQUENTIAL: save at 3 + resume to 6 equals 6 uninterrupted (losses and eval loss)" 1
else
  record "SEQUENTIAL: save at 3 + resume to 6 equals 6 uninterrupted (losses and eval loss)" 0 \
    "$TMP/first.err" "$TMP/second.err" "$TMP/resume.cmp" "$TMP/resumed" "$TMP/SEQUENTIAL.2"
fi

# fsdp-ckpt verify passes the Sequential's checkpoint (BatchNorm's buffers in their own dtypes,
# num_batches_tracked I64) and still refuses a master weight that is not F32 and a buffer in
# another dtype than the one it was saved in (each retyped in its header, same item size).
retype() {  # retype DIR TENSOR DTYPE
  python3 - "$@" <<'PY'
import glob, json, struct, sys
for path in glob.glob(sys.argv[1] + "/model*.safetensors"):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if sys.argv[2] in header:
        header[sys.argv[2]]["dtype"] = sys.argv[3]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        open(path, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
PY
}
good="$TMP/resume/$(cat "$TMP/resume/latest" 2>/dev/null)"
timeout -k 5 60 "$FSDP_CKPT" verify "$good" >"$TMP/verify-good.out" 2>&1
rc_good=$?
rm -rf "$TMP/bad-master" "$TMP/bad-buffer"
cp -r "$good" "$TMP/bad-master" && retype "$TMP/bad-master" 0.weight I32
timeout -k 5 60 "$FSDP_CKPT" verify "$TMP/bad-master" >"$TMP/verify-master.out" 2>&1
rc_master=$?
cp -r "$good" "$TMP/bad-buffer" && retype "$TMP/bad-buffer" 1.num_batches_tracked F64
timeout -k 5 60 "$FSDP_CKPT" verify "$TMP/bad-buffer" >"$TMP/verify-buffer.out" 2>&1
rc_buffer=$?
if [ $rc_good = 0 ] && [ $rc_master = 1 ] && [ $rc_buffer = 1 ] &&
   grep -q "tensor '0.weight' is I32; model tensors other than buffers are F32" "$TMP/verify-master.out" &&
   grep -q "tensor '1.num_batches_tracked' is F64; the index records the buffer as \"I64\"" "$TMP/verify-buffer.out"; then
  record "SEQUENTIAL: fsdp-ckpt verify passes its checkpoint (I64 buffers) and refuses a retyped master or buffer" 1
else
  record "SEQUENTIAL: fsdp-ckpt verify passes its checkpoint (I64 buffers) and refuses a retyped master or buffer" 0 \
    "$TMP/verify-good.out" "$TMP/verify-master.out" "$TMP/verify-buffer.out"
fi

# Malformed input: the saved checkpoint's BatchNorm running_mean rewritten as [32, 2] (same bytes,
# another shape). --resume must fail within the timeout, naming the buffer and both shapes (the
# first rank to fail stops the job, so one rank's message is what is sure to show), and leave the
# checkpoint's files as they were.
ckpt=$(cat "$TMP/resume/latest" 2>/dev/null)
ckpt_dir="$TMP/resume/$ckpt"
python3 - "$ckpt_dir" >"$TMP/mangle.out" 2>&1 <<'PY'
import glob, json, struct, sys
for path in sorted(glob.glob(sys.argv[1] + "/model*.safetensors")):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k.endswith("running_mean")]
    if not names:
        continue
    header[names[0]]["shape"] = [header[names[0]]["shape"][0] // 2, 2]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data offsets count from the header's end: any length works
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    print(names[0])
    sys.exit(0)
sys.exit("no running_mean in " + sys.argv[1])
PY
mangled=$(cat "$TMP/mangle.out")
sum_before=$(cat "$ckpt_dir"/* | md5sum)
start=$SECONDS
run 2 "$TMP/bad" "$FSDP_EXAMPLE_SEQUENTIAL" --steps 6 --out "$TMP/resume" --resume
elapsed=$((SECONDS - start))
sum_after=$(cat "$ckpt_dir"/* | md5sum)
if [ -n "$ckpt" ] && [ "$RC" != 0 ] && [ "$elapsed" -lt 100 ] && [ "$sum_before" = "$sum_after" ] &&
   grep -q "tensor '$mangled' has shape \[32, 2\] but the model's has shape \[64\]" "$TMP/bad.err"; then
  record "SEQUENTIAL: a checkpoint buffer of the wrong shape fails --resume, naming it ($elapsed s)" 1
else
  record "SEQUENTIAL: a checkpoint buffer of the wrong shape fails --resume, naming it" 0 \
    "$TMP/mangle.out" "$TMP/bad.raw" "$TMP/bad.err"
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
