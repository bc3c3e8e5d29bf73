#!/usr/bin/env bash
# End-to-end test of offload in fsdp-train: the same tiny fp32 job on 2 ranks with the disk tier
# (params, grads and optimizer state in files under fsdp.offload.dir) and with the host tier gives
# bit-identical losses to no offload; a checkpoint saved with the disk tier resumes bitwise; the
# start-of-run memory plan shows the tiers; an unwritable offload.dir fails before the first step.
# Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train tests/e2e/offload_e2e_test.sh
#        (ctest sets both; about 20 s on 2 cores)
set -u

. "$(dirname "${BASH_SOURCE[0]}")/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN FSDP_TRAIN_TEST
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
TRAIN_TEST=$FSDP_TRAIN_TEST  # fsdp-train with the FSDP_TRAIN_TEST_* hooks (tests only)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=1
ok() { passed=$((passed + 1)); echo "ok: $*"; }
bad() { failed=$((failed + 1)); echo "FAILED: $*"; }

TINY=(--set model.vocab_size=64 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set data.seq_len=16 --set data.batch_size_per_rank=4 --set train.eval_every=0
      --set optim.warmup_steps=2 --set optim.schedule=constant --set train.log_every=1)
DISK=(--set fsdp.offload.params=disk --set fsdp.offload.grads=disk --set fsdp.offload.optimizer_state=disk
      --set "fsdp.offload.dir=$TMP/offload" --set fsdp.offload.memory_budget_bytes=1048576)
HOST=(--set fsdp.offload.params=host --set fsdp.offload.grads=host --set fsdp.offload.optimizer_state=host)

train() {  # [PROGRAM=...] train OUT ARGS...: 2 ranks of $PROGRAM (default fsdp-train); leaves RC and OUT.out / OUT.err
  local out=$1
  shift
  timeout -k 5 120 "$RUN" --nproc-per-node 2 --timeout-s 100 -- "${PROGRAM:-$TRAIN}" "${TINY[@]}" "$@" >"$out.out" 2>"$out.err" </dev/null
  RC=$?
}
losses() { grep -o '"loss": *[^,}]*' "$1" | grep -v '"eval"' ; }

train "$TMP/none" --steps 6 --metrics "$TMP/none.jsonl"
[ "$RC" = 0 ] || bad "no offload run exited $RC: $(tail -3 "$TMP/none.err")"
train "$TMP/disk" --steps 6 --metrics "$TMP/disk.jsonl" "${DISK[@]}"
if [ "$RC" = 0 ] && [ -s "$TMP/none.jsonl" ] && [ "$(losses "$TMP/disk.jsonl")" = "$(losses "$TMP/none.jsonl")" ]; then
  ok "disk tier: losses bitwise equal to no offload ($(losses "$TMP/disk.jsonl" | wc -l) steps)"
else
  bad "disk tier run (rc $RC) losses differ: $(losses "$TMP/disk.jsonl" | tr '\n' ' ') vs $(losses "$TMP/none.jsonl" | tr '\n' ' ') $(tail -3 "$TMP/disk.err")"
fi
if grep -q "sharded states in the disk tier" "$TMP/disk.out" && grep -q "by tier: device .*disk" "$TMP/disk.out"; then
  ok "memory plan and report show the disk tier"
else
  bad "memory plan/report without tiers: $(grep -i memory "$TMP/disk.out")"
fi
if [ -z "$(ls -A "$TMP/offload" 2>/dev/null)" ]; then ok "offload.dir left empty (files unlinked)"; else bad "offload.dir not empty: $(ls "$TMP/offload")"; fi
train "$TMP/host" --steps 6 --metrics "$TMP/host.jsonl" "${HOST[@]}"
if [ "$RC" = 0 ] && [ "$(losses "$TMP/host.jsonl")" = "$(losses "$TMP/none.jsonl")" ]; then
  ok "host tier: losses bitwise equal to no offload"
else
  bad "host tier run (rc $RC) differs: $(tail -3 "$TMP/host.err")"
fi

# Resume: 3 steps + save with the disk tier, then 3 more in fresh processes with the disk tier.
train "$TMP/first" --steps 3 --save-dir "$TMP/ckpt" "${DISK[@]}"
train "$TMP/resumed" --steps 6 --save-dir "$TMP/ckpt" --resume latest --metrics "$TMP/resumed.jsonl" "${DISK[@]}"
if [ "$RC" = 0 ] && [ "$(losses "$TMP/resumed.jsonl")" = "$(losses "$TMP/none.jsonl" | tail -3)" ]; then
  ok "resume with the disk tier: steps 4-6 bitwise equal to the uninterrupted run"
else
  bad "resume with the disk tier (rc $RC): $(losses "$TMP/resumed.jsonl" | tr '\n' ' ') vs $(losses "$TMP/none.jsonl" | tail -3 | tr '\n' ' ') $(tail -3 "$TMP/resumed.err")"
fi

# The save above was written during step 3's optimizer step (train.save_in_step auto, the state in
# the disk tier): the same files as a save made after the step, and said so.
train "$TMP/plain" --steps 3 --save-dir "$TMP/ckpt-plain" "${DISK[@]}" --set train.save_in_step=off
same=yes
for f in "$TMP/ckpt-plain/step-00000003/"*.safetensors; do
  cmp -s "$f" "$TMP/ckpt/step-00000003/$(basename "$f")" || same="no: $(basename "$f")"
done
if [ "$RC" = 0 ] && [ "$same" = yes ] && grep -q "MB of it written during step 3's optimizer phase" "$TMP/first.out" &&
  ! grep -q "written during" "$TMP/plain.out" && grep -q "written during the step before each" "$TMP/first.out"; then
  ok "save written during the step: files equal to a save after it"
else
  bad "save in step (rc $RC): files equal: $same; $(grep "saved checkpoint" "$TMP/first.out" "$TMP/plain.out")"
fi

# optim.step_in_backward: each unit stepped during the backward, its disk-tier state read and
# written under the rest of it; the same losses as stepping after backward (clipping off in both).
train "$TMP/noclip" --steps 6 --metrics "$TMP/noclip.jsonl" --set optim.grad_clip=0
train "$TMP/inbwd" --steps 6 --metrics "$TMP/inbwd.jsonl" --set optim.grad_clip=0 --set optim.step_in_backward=true \
  --set fsdp.offload.params=disk --set fsdp.offload.optimizer_state=disk --set "fsdp.offload.dir=$TMP/offload" \
  --set fsdp.offload.memory_budget_bytes=1048576
if [ "$RC" = 0 ] && [ -s "$TMP/noclip.jsonl" ] && [ "$(losses "$TMP/inbwd.jsonl")" = "$(losses "$TMP/noclip.jsonl")" ] &&
  grep -q "steps in backward" "$TMP/inbwd.out"; then
  ok "step in backward with the disk tier: losses bitwise equal to stepping after backward"
else
  bad "step in backward (rc $RC): $(losses "$TMP/inbwd.jsonl" | tr '\n' ' ') vs $(losses "$TMP/noclip.jsonl" | tr '\n' ' ') $(tail -3 "$TMP/inbwd.err")"
fi
train "$TMP/inbwd-clip" --steps 3 --metrics "$TMP/inbwd-clip.jsonl" --set optim.step_in_backward=true
if [ "$RC" != 0 ] && grep -q "optim.step_in_backward.*needs optim.grad_clip 0" "$TMP/inbwd-clip.err" &&
  [ ! -s "$TMP/inbwd-clip.jsonl" ]; then
  ok "step in backward with clipping: refused before any step, naming both keys"
else
  bad "step in backward with clipping: rc $RC, $(head -5 "$TMP/inbwd-clip.err")"
fi

# A non-finite gradient cannot be skipped when the step is taken in backward: every rank stops
# before saving that step, and the last checkpoint stays the latest.
PROGRAM=$TRAIN_TEST FSDP_TRAIN_TEST_INF_GRAD=0:2 train "$TMP/inbwd-inf" --steps 4 --set optim.grad_clip=0 --set optim.step_in_backward=true \
  --set train.save_every=1 --save-dir "$TMP/inbwd-ckpt"
if [ "$RC" != 0 ] && grep -q "non-finite loss or gradient at step 2 with optim.step_in_backward" "$TMP/inbwd-inf.err" &&
  [ -d "$TMP/inbwd-ckpt/step-00000001" ] && [ ! -e "$TMP/inbwd-ckpt/step-00000002" ] &&
  [ "$(cat "$TMP/inbwd-ckpt/latest")" = step-00000001 ]; then
  ok "step in backward, inf gradient at step 2: stopped (rc $RC) before saving it, step 1 still the latest"
else
  bad "step in backward with an inf gradient: rc $RC, $(ls "$TMP/inbwd-ckpt" 2>&1 | tr '\n' ' ') $(tail -3 "$TMP/inbwd-inf.err")"
fi

# An offload.dir that cannot be created fails before training, naming it.
echo x >"$TMP/file"
train "$TMP/unwritable" --steps 3 --metrics "$TMP/unwritable.jsonl" "${DISK[@]}" --set "fsdp.offload.dir=$TMP/file/offload"
if [ "$RC" != 0 ] && grep -q "offload.dir $TMP/file/offload" "$TMP/unwritable.err" && [ ! -s "$TMP/unwritable.jsonl" ]; then
  ok "unwritable offload.dir: exit $RC before any step, message names it"
else
  bad "unwritable offload.dir: rc $RC, $(cat "$TMP/unwritable.err" | head -5)"
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
