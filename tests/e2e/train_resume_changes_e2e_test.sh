#!/usr/bin/env bash
# End-to-end tests of a --resume that changes the run (apps/fsdp-train/resume_review.h, Note [Resume
# changes]), on 2 ranks through fsdp-run: a tiny job trains 8 steps of a cosine schedule, saving at
# steps 4 and 8; then
#  - --steps 12 from step 8 (the cosine re-stretched: the lr would jump from min_lr) is refused with
#    status 2 on both ranks before anything is loaded or written: the save dir and metrics untouched;
#  - the same with --allow-schedule-change goes ahead, prints the change with both lrs, and the lr
#    the metrics log at step 9 is the new one it printed;
#  - a resume of step 4 on 1 rank (global batch 4 -> 2) prints the change and trains on;
#  - a checkpoint without the saved schedule (an older fsdp-train's) resumes with a warning.
# Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train tests/e2e/train_resume_changes_e2e_test.sh
#        (ctest sets both; about 15 s on 2 cores; "N passed, M failed")
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
PY=$(command -v python3)
scratch_dir resume-changes

TINY=(--set model.vocab_size=64 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set data.seq_len=16 --set data.batch_size_per_rank=2 --set train.eval_every=0 --set train.log_every=1
      --set optim.warmup_steps=1)

train() {  # train NPROC NAME ARGS...: leaves RC and $TMP/NAME.out (stdout and stderr together)
  local nproc=$1 name=$2
  shift 2
  timeout -k 5 120 "$RUN" --nproc-per-node "$nproc" --timeout-s 100 -- "$TRAIN" "${TINY[@]}" "$@" \
    >"$TMP/$name.out" 2>&1 </dev/null
  RC=$?
}
has() { grep -qF -- "$2" "$TMP/$1.out"; }  # has NAME TEXT
listing() { (cd "$1" && find . | sort && cat latest); }

train 2 base --steps 8 --set train.save_every=4 --save-dir "$TMP/ckpt" --metrics "$TMP/base.jsonl"
ok=0
[ "$RC" -eq 0 ] && [ -f "$TMP/ckpt/step-00000004/train_state.json" ] && [ -f "$TMP/ckpt/step-00000008/train_state.json" ] && ok=1
record "fsdp-train on 2 ranks saves step-00000004 and step-00000008 of a cosine schedule (status $RC)" $ok "$TMP/base.out"
if [ "$ok" != 1 ]; then
  echo "$passed passed, $failed failed"
  exit 1
fi

# ---- more steps: refused by default ---------------------------------------------------------------
listing "$TMP/ckpt" >"$TMP/before.txt"
cp "$TMP/base.jsonl" "$TMP/metrics.jsonl"
train 2 refused --steps 12 --save-dir "$TMP/ckpt" --resume latest --metrics "$TMP/metrics.jsonl"
listing "$TMP/ckpt" >"$TMP/after.txt"
ok=0
msg="the learning rate would jump at step 9 from 0.0006 (what the saved run's schedule gives there) to 0.002"
if [ "$RC" -eq 2 ] && grep -qF "[rank 0] fsdp-train: error: --resume $TMP/ckpt/step-00000008 at step 8: $msg" "$TMP/refused.out" &&
   grep -qF "[rank 1] fsdp-train: error: --resume $TMP/ckpt/step-00000008 at step 8: $msg" "$TMP/refused.out" &&
   has refused "train.steps 8 -> 12 (the cosine schedule is re-stretched to reach min_lr at step 12)" &&
   has refused "Resume with the saved run's settings (--steps 8)" && has refused "pass --allow-schedule-change" &&
   ! has refused "step 9/12" && cmp -s "$TMP/before.txt" "$TMP/after.txt" && cmp -s "$TMP/base.jsonl" "$TMP/metrics.jsonl"; then
  ok=1
fi
record "--steps 8 -> 12 on resume: refused on both ranks (status $RC), naming both lrs and the ways out; checkpoints and metrics untouched" \
  $ok "$TMP/refused.out"

# ---- the same, accepted --------------------------------------------------------------------------
train 2 accepted --steps 12 --save-dir "$TMP/ckpt" --resume latest --metrics "$TMP/metrics.jsonl" --allow-schedule-change
line=$(grep -o "resume: train.steps 8 -> 12: the cosine schedule is re-stretched to reach min_lr at step 12; lr at step 9 goes from 0.0006 to [0-9.e-]*" "$TMP/accepted.out")
printed=${line##* to }
ok=0
if [ "$RC" -eq 0 ] && [ -n "$line" ] && has accepted "resume: the lr change is accepted (--allow-schedule-change)" &&
   [ -f "$TMP/ckpt/step-00000012/train_state.json" ] &&
   "$PY" - "$TMP/metrics.jsonl" "$printed" >"$TMP/lr.log" 2>&1 <<'EOF'
import json, sys
steps = {r["step"]: r for r in map(json.loads, open(sys.argv[1])) if "lr" in r}
lr9, printed = steps[9]["lr"], float(sys.argv[2])
print(f"lr at step 9 {lr9}, printed {printed}, at step 8 {steps[8]['lr']}")
assert abs(lr9 - printed) <= 1e-3 * printed and lr9 > 2 * steps[8]["lr"], "not the printed lr, or no jump"
EOF
then ok=1; fi
record "with --allow-schedule-change: trains to step 12, prints the change; lr at step 9 is the printed $printed" \
  $ok "$TMP/accepted.out" "$TMP/lr.log"

# ---- another world size: the global batch ---------------------------------------------------------
train 1 world --steps 8 --save-dir "$TMP/one" --resume "$TMP/ckpt/step-00000004"
ok=0
if [ "$RC" -eq 0 ] && has world "resume: global batch 4 -> 2 samples per step (world size 2 -> 1): the data continues at sample 16" &&
   [ -f "$TMP/one/step-00000008/train_state.json" ] && ! has world "would jump"; then ok=1; fi
record "resume of step 4 on 1 rank prints the global batch change 4 -> 2 and trains to step 8 (status $RC)" $ok "$TMP/world.out"

# ---- an older checkpoint: no saved schedule -------------------------------------------------------
cp -r "$TMP/ckpt/step-00000008" "$TMP/old"
"$PY" - "$TMP/old/train_state.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
del s["extra"]["lr_schedule"]
json.dump(s, open(sys.argv[1], "w"))
EOF
train 2 old --steps 12 --save-dir "$TMP/oldsave" --resume "$TMP/old"
ok=0
if [ "$RC" -eq 0 ] && has old "resume: warning: $TMP/old does not record its run's learning-rate schedule and global batch" &&
   [ -f "$TMP/oldsave/step-00000012/train_state.json" ]; then ok=1; fi
record "a checkpoint without extra.lr_schedule resumes with a warning that it cannot compare (status $RC)" $ok "$TMP/old.out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
