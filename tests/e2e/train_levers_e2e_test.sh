#!/usr/bin/env bash
# End-to-end tests of fsdp-train's data formats, safe precision and memory levers, through fsdp-run:
#  - scripts/tokenize (a BPE trained here) writes uint16 / uint32 token files that train with a
#    held-out eval file, whose eval lines carry perplexity = exp(loss); bad token files (an id past
#    the vocabulary, an eval file shorter than one sample, the wrong data.token_dtype, a size that is
#    not a multiple of the token width) fail with status 2 before the first step, naming file and field;
#  - an inf injected into one rank's gradient skips that step on every rank (fp16 with dynamic loss
#    scaling: the scale halves) and training goes on; K skips in a row stop the run (status 1)
#    without a checkpoint of the failing step;
#  - gradient accumulation gives the losses of the run with the larger batch and reduce-scatters
#    once per step; activation checkpointing (every layer, every 2nd) leaves the losses unchanged,
#    and so does a loss chunked over the tokens (train.loss_chunk_tokens, to fp32 rounding);
#    async saves commit every checkpoint before exit and resume like synchronous ones; units kept
#    gathered across micro-batches give the same losses bit for bit with fewer all-gathers; AdamW's
#    moments in bf16 halve the optimizer's bytes and keep the losses within 1%; HYBRID_SHARD's
#    micro-batches accumulate each way train.accumulation offers with the same losses and the
#    replicas' all-reduce once per step unless every micro-batch reduces in full; the memory
#    plan's figure for each lever is within 10% of the measured one.
# Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train tests/e2e/train_levers_e2e_test.sh
#        (ctest sets both; about 40 s on 2 cores; "N passed, M failed")
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
. "$HERE/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN FSDP_TRAIN_TEST
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
TRAIN_TEST=$FSDP_TRAIN_TEST  # fsdp-train with the FSDP_TRAIN_TEST_* hooks (tests only)
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=$(command -v python3)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# A model big enough that its activations (several MiB) dwarf the allocator's noise, small enough
# that a step takes a few tens of milliseconds.
SMALL=(--set model.vocab_size=256 --set model.hidden_size=64 --set model.intermediate_size=128
       --set model.num_hidden_layers=4 --set model.num_attention_heads=4 --set model.num_key_value_heads=4
       --set data.seq_len=64 --set data.batch_size_per_rank=8 --set train.eval_every=0
       --set optim.warmup_steps=2 --set train.log_every=1)

train() {  # [PROGRAM=...] train NPROC OUT_PREFIX ARGS...: $PROGRAM (default fsdp-train); leaves RC, OUT_PREFIX.out/.err
  local nproc=$1 out=$2
  shift 2
  timeout -k 5 120 "$RUN" --nproc-per-node "$nproc" --timeout-s 100 -- "${PROGRAM:-$TRAIN}" "$@" >"$out.out" 2>"$out.err" </dev/null
  RC=$?
}

# py FILE.py ARGS...: runs a check; its message goes to $TMP/py.log
check() {
  "$PY" - "$@" >"$TMP/py.log" 2>&1
}

# ---- data: tokenize, uint32, eval file -----------------------------------------------------------
cat >"$TMP/bpe.py" <<'EOF'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train([sys.argv[1]], trainers.BpeTrainer(vocab_size=int(sys.argv[3]), special_tokens=["<|endoftext|>"],
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(sys.argv[2])
EOF
for f in "$ROOT"/scripts/tokenize "$ROOT"/README.md "$ROOT"/docs/*.md; do cat "$f"; done >"$TMP/corpus.txt"
"$PY" -c 'import json,sys; [print(json.dumps({"text": l})) for l in open(sys.argv[1]).read().split("\n\n")[:40]]' \
  "$ROOT/docs/ARCHITECTURE.md" >"$TMP/held.jsonl"
"$PY" "$TMP/bpe.py" "$TMP/corpus.txt" "$TMP/tok.json" 400 >"$TMP/bpe.log" 2>&1
"$ROOT/scripts/tokenize" --tokenizer "$TMP/tok.json" --out "$TMP/train.bin" "$TMP/corpus.txt" >"$TMP/tok.out" 2>&1
rc1=$?
"$ROOT/scripts/tokenize" --tokenizer "$TMP/tok.json" --out "$TMP/eval32.bin" --dtype uint32 "$TMP/held.jsonl" \
  >"$TMP/tok32.out" 2>&1
rc2=$?
"$ROOT/scripts/tokenize" --tokenizer "$TMP/tok.json" --out "$TMP/train32.bin" --dtype uint32 "$TMP/corpus.txt" \
  >>"$TMP/tok32.out" 2>&1
rc3=$?
ok=0
if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $rc3 -eq 0 ] && grep -q "data.token_dtype=uint16" "$TMP/tok.out" &&
   [ $(($(stat -c %s "$TMP/train32.bin") / 2)) -eq "$(stat -c %s "$TMP/train.bin")" ]; then ok=1; fi
record "scripts/tokenize writes uint16 and uint32 token files from text and JSON lines" $ok "$TMP/tok.out" \
  "$TMP/tok32.out" "$TMP/bpe.log"

TOKS=(--set model.vocab_size=400 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=2 --set model.num_key_value_heads=2
      --set data.seq_len=32 --set data.batch_size_per_rank=4 --set optim.warmup_steps=2 --set train.eval_batches=2)
train 2 "$TMP/tok" "${TOKS[@]}" --set data.source=file --set data.path="$TMP/train32.bin" \
  --set data.token_dtype=uint32 --set data.eval_path="$TMP/eval32.bin" --steps 6 --set train.eval_every=3 \
  --metrics "$TMP/tok.jsonl"
ok=0
if [ "$RC" -eq 0 ] && check "$TMP/tok.jsonl" <<'EOF'
import json, math, sys
ev = [j for j in map(json.loads, open(sys.argv[1])) if j.get("eval")]
assert [j["step"] for j in ev] == [0, 3, 6], ev
for j in ev:
    assert abs(j["perplexity"] - math.exp(j["loss"])) < 1e-9 * j["perplexity"], j
assert ev[-1]["loss"] < ev[0]["loss"], ev
EOF
then ok=1; fi
record "uint32 tokens train on 2 ranks with an eval file; eval lines carry perplexity" $ok "$TMP/tok.out" \
  "$TMP/tok.err" "$TMP/py.log"

# bad_data NAME TEXT... -- ARGS: status 2, every TEXT on stderr, no step taken
bad_data() {
  local name=$1
  shift
  local texts=()
  while [ "$1" != "--" ]; do texts+=("$1"); shift; done
  shift
  train 2 "$TMP/bad" "${TOKS[@]}" --steps 2 "$@"
  local ok=0
  if [ "$RC" -eq 2 ] && ! grep -q "^step " "$TMP/bad.out"; then
    ok=1
    for t in "${texts[@]}"; do grep -qF -- "$t" "$TMP/bad.err" || ok=0; done
  fi
  record "$name (status $RC)" $ok "$TMP/bad.err"
}
"$PY" -c 'import sys; open(sys.argv[1], "wb").write(bytes(range(7)))' "$TMP/odd32.bin"
head -c 40 "$TMP/train.bin" >"$TMP/short.bin"
bad_data "a token id past the vocabulary names file and id" "data file '$TMP/train.bin': token id" \
  "is >= model.vocab_size=100" -- --set data.source=file --set data.path="$TMP/train.bin" --set model.vocab_size=100
bad_data "an eval file shorter than one sample names file and field" \
  "eval file '$TMP/short.bin' (data.eval_path): holds 20 tokens" -- --set data.source=file \
  --set data.path="$TMP/train.bin" --set data.eval_path="$TMP/short.bin"
bad_data "uint32 tokens read as uint16 name data.token_dtype" "data file '$TMP/train32.bin'" \
  'set data.token_dtype="uint32"' -- --set data.source=file --set data.path="$TMP/train32.bin"
bad_data "a size that is not a multiple of the token width names data.token_dtype" \
  "data file '$TMP/odd32.bin': has 7 bytes, not a multiple of 4 (data.token_dtype=\"uint32\")" -- \
  --set data.source=file --set data.path="$TMP/odd32.bin" --set data.token_dtype=uint32

# ---- safe precision ---------------------------------------------------------------------------------
PROGRAM=$TRAIN_TEST FSDP_TRAIN_TEST_INF_GRAD=1:3 train 2 "$TMP/fp16" "${SMALL[@]}" --steps 6 --set fsdp.param_dtype=float16 \
  --set fsdp.loss_scale_init=1024 --metrics "$TMP/fp16.jsonl"
ok=0
if [ "$RC" -eq 0 ] && check "$TMP/fp16.jsonl" <<'EOF'
import json, math, sys
st = [j for j in map(json.loads, open(sys.argv[1])) if not j.get("eval")]
assert [j["skipped"] for j in st] == [False, False, True, False, False, False], st
assert [j["skipped_steps"] for j in st] == [0, 0, 1, 1, 1, 1], st
assert [j["loss_scale"] for j in st] == [1024, 1024, 512, 512, 512, 512], st
assert all(math.isfinite(j["loss"]) for j in st) and st[-1]["loss"] < st[0]["loss"], st
EOF
then ok=1; fi
record "fp16: an inf in rank 1's gradient skips step 3 on every rank, the loss scale halves, training goes on" \
  $ok "$TMP/fp16.out" "$TMP/fp16.err" "$TMP/py.log"

PROGRAM=$TRAIN_TEST FSDP_TRAIN_TEST_INF_GRAD=0:2,3,4 train 2 "$TMP/stop" "${SMALL[@]}" --steps 6 --set train.max_consecutive_skips=3 \
  --set train.save_every=1 --save-dir "$TMP/stop-ckpt" --metrics "$TMP/stop.jsonl"
ok=0
if [ "$RC" -eq 1 ] && grep -qF "3 steps in a row had a non-finite loss or gradient" "$TMP/stop.err" &&
   [ -d "$TMP/stop-ckpt/step-00000003" ] && [ ! -e "$TMP/stop-ckpt/step-00000004" ] &&
   [ "$(cat "$TMP/stop-ckpt/latest")" = step-00000003 ]; then ok=1; fi
record "fp32: 3 skips in a row stop the run (status $RC) with no checkpoint of the failing step" $ok \
  "$TMP/stop.out" "$TMP/stop.err"

# ---- memory levers ----------------------------------------------------------------------------------
# lever_error OUT NAME: the plan-vs-measured error (percent) that OUT's report line gives NAME
lever_error() {
  sed -n "s/.*plan vs measured.* $2 [0-9.]* vs [0-9.]* MiB (\([-+0-9.]*\)%).*/\1/p" "$1"
}
within10() {  # within10 OUT NAME...: every NAME was measured and is within 10% of the plan
  local out=$1 name e
  shift
  for name in "$@"; do
    e=$(lever_error "$out" "$name")
    [ -n "$e" ] || return 1
    awk -v e="$e" 'BEGIN { exit !(e <= 10 && e >= -10) }' || return 1
  done
}

train 2 "$TMP/base" "${SMALL[@]}" --steps 4 --metrics "$TMP/base.jsonl"
ok=0
if [ "$RC" -eq 0 ] && within10 "$TMP/base.out" activations; then ok=1; fi
record "no checkpointing: activations within 10% of the plan ($(lever_error "$TMP/base.out" activations)%)" $ok \
  "$TMP/base.out" "$TMP/base.err"

cat >"$TMP/same.py" <<'EOF'
import json, sys
def steps(p):
    return [j for j in map(json.loads, open(p)) if not j.get("eval")]
a, b, tol = steps(sys.argv[1]), steps(sys.argv[2]), float(sys.argv[3])
assert len(a) == len(b) > 0
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= tol * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
if len(sys.argv) > 4:  # reduce-scatter bytes per step equal too
    assert all(x["reduce_scatter_bytes"] == y["reduce_scatter_bytes"] for x, y in zip(a, b)), (a[0], b[0])
print("losses", [round(x["loss"], 5) for x in b])
EOF
for n in every 2; do
  train 2 "$TMP/ac$n" "${SMALL[@]}" --steps 4 --set train.activation_checkpointing=$n --metrics "$TMP/ac$n.jsonl"
  ok=0
  if [ "$RC" -eq 0 ] && "$PY" "$TMP/same.py" "$TMP/base.jsonl" "$TMP/ac$n.jsonl" 1e-6 >"$TMP/py.log" 2>&1 &&
     within10 "$TMP/ac$n.out" activations; then ok=1; fi
  record "activation checkpointing ($n): same losses, activations within 10% of the plan \
($(lever_error "$TMP/ac$n.out" activations)%)" $ok "$TMP/ac$n.out" "$TMP/ac$n.err" "$TMP/py.log"
done

# The loss chunked over 100 of each rank's 512 tokens: the same losses to fp32 rounding, and the
# activations (no logits kept) within 10% of the plan.
train 2 "$TMP/chunk" "${SMALL[@]}" --steps 4 --set train.loss_chunk_tokens=100 --metrics "$TMP/chunk.jsonl"
ok=0
if [ "$RC" -eq 0 ] && "$PY" "$TMP/same.py" "$TMP/base.jsonl" "$TMP/chunk.jsonl" 1e-5 >"$TMP/py.log" 2>&1 &&
   within10 "$TMP/chunk.out" activations; then ok=1; fi
record "loss chunked by 100 tokens: same losses, activations within 10% of the plan \
($(lever_error "$TMP/chunk.out" activations)%)" $ok "$TMP/chunk.out" "$TMP/chunk.err" "$TMP/py.log"

train 2 "$TMP/big" "${SMALL[@]}" --steps 4 --set data.batch_size_per_rank=8 --metrics "$TMP/big.jsonl"
train 2 "$TMP/acc" "${SMALL[@]}" --steps 4 --set data.batch_size_per_rank=2 --set train.grad_accum_steps=4 \
  --metrics "$TMP/acc.jsonl"
ok=0
if [ "$RC" -eq 0 ] && "$PY" "$TMP/same.py" "$TMP/big.jsonl" "$TMP/acc.jsonl" 1e-5 rs >"$TMP/py.log" 2>&1 &&
   within10 "$TMP/acc.out" accumulated_gradients; then ok=1; fi
record "4 micro-batches of 2: the losses and reduce-scatter bytes of batch 8, accumulated gradients within 10% \
($(lever_error "$TMP/acc.out" accumulated_gradients)%)" $ok "$TMP/acc.out" "$TMP/acc.err" "$TMP/py.log"

# Units kept gathered across 4 micro-batches: the losses of gathering per micro-batch, bit for bit,
# with fewer all-gather bytes per step.
train 2 "$TMP/keep" "${SMALL[@]}" --steps 4 --set data.batch_size_per_rank=2 --set train.grad_accum_steps=4 \
  --set train.keep_gathered=true --metrics "$TMP/keep.jsonl"
cat >"$TMP/keep.py" <<'EOF'
import json, sys
def steps(p):
    return [j for j in map(json.loads, open(p)) if not j.get("eval")]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
assert len(a) == len(b) > 0
assert [x["loss"] for x in a] == [y["loss"] for y in b], ([x["loss"] for x in a], [y["loss"] for y in b])
ratio = b[-1]["allgather_bytes"][0] / a[-1]["allgather_bytes"][0]
assert ratio < 0.5, ratio
print("all-gather bytes kept / regathered", ratio)
EOF
ok=0
if [ "$RC" -eq 0 ] && "$PY" "$TMP/keep.py" "$TMP/acc.jsonl" "$TMP/keep.jsonl" >"$TMP/py.log" 2>&1; then ok=1; fi
record "train.keep_gathered over 4 micro-batches: the same losses bit for bit, $(tail -1 "$TMP/py.log")" $ok \
  "$TMP/keep.out" "$TMP/keep.err" "$TMP/py.log"

# AdamW's moments in bf16: half the optimizer's bytes, the losses within 1% of fp32 moments.
train 2 "$TMP/bf16s" "${SMALL[@]}" --steps 4 --set optim.state_dtype=bfloat16 --metrics "$TMP/bf16s.jsonl"
ok=0
optimizer_mib() { sed -n 's/.*params [0-9.]* MiB, grads [0-9.]* MiB, optimizer \([0-9.]*\) MiB.*/\1/p' "$1" | head -1; }
if [ "$RC" -eq 0 ] && "$PY" "$TMP/same.py" "$TMP/base.jsonl" "$TMP/bf16s.jsonl" 1e-2 >"$TMP/py.log" 2>&1 &&
   awk -v a="$(optimizer_mib "$TMP/base.out")" -v b="$(optimizer_mib "$TMP/bf16s.out")" \
     'BEGIN { exit !(a > 0 && b > 0 && b / a > 0.49 && b / a < 0.51) }'; then ok=1; fi
record "optim.state_dtype=bfloat16: losses within 1% of fp32 moments, optimizer state $(optimizer_mib "$TMP/bf16s.out") \
vs $(optimizer_mib "$TMP/base.out") MiB" $ok "$TMP/bf16s.out" "$TMP/bf16s.err" "$TMP/py.log"

# HYBRID_SHARD on 4 ranks as 2 replicas of 2, 4 micro-batches of 2, each way of accumulating: the
# same losses; the replicas' all-reduce once per step unless every micro-batch reduces in full;
# reduce_scatter's partial sums within 10% of the plan.
HSDP=(--set fsdp.strategy=HYBRID_SHARD --set fsdp.replicate=2 --set data.batch_size_per_rank=2
      --set train.grad_accum_steps=4)
for a in no_sync reduce_scatter reduce; do
  train 4 "$TMP/hsdp-$a" "${SMALL[@]}" "${HSDP[@]}" --steps 3 --set train.accumulation=$a --metrics "$TMP/hsdp-$a.jsonl"
  eval "rc_$a=\$RC"
done
cat >"$TMP/hsdp.py" <<'EOF'
import json, sys
def steps(p):
    return [j for j in map(json.loads, open(p)) if not j.get("eval")]
ns, rs, full = (steps(p) for p in sys.argv[1:4])
assert len(ns) == len(rs) == len(full) > 0
for x, y, z in zip(ns, rs, full):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]) and abs(x["loss"] - z["loss"]) <= 1e-5 * abs(x["loss"])
    # The gradient all-reduce: once per step with no_sync and reduce_scatter, four times with reduce.
    assert x["all_reduce_bytes"] == y["all_reduce_bytes"], (x["all_reduce_bytes"], y["all_reduce_bytes"])
    ratio = (z["all_reduce_bytes"][0] - y["all_reduce_bytes"][0]) / y["all_reduce_bytes"][0]
    assert 2.9 <= ratio <= 3.0, ratio
    # Reduce-scatters: once per step with no_sync, per micro-batch otherwise.
    assert y["reduce_scatter_bytes"] == z["reduce_scatter_bytes"]
    assert y["reduce_scatter_bytes"][0] == 4 * x["reduce_scatter_bytes"][0], (x, y)
print("ok", [x["all_reduce_bytes"][0] for x in (ns[-1], rs[-1], full[-1])])
EOF
ok=0
if [ $rc_no_sync -eq 0 ] && [ $rc_reduce_scatter -eq 0 ] && [ $rc_reduce -eq 0 ] &&
   "$PY" "$TMP/hsdp.py" "$TMP/hsdp-no_sync.jsonl" "$TMP/hsdp-reduce_scatter.jsonl" "$TMP/hsdp-reduce.jsonl" \
     >"$TMP/py.log" 2>&1 &&
   within10 "$TMP/hsdp-reduce_scatter.out" partial_gradient_sums; then ok=1; fi
record "HYBRID_SHARD 2x2, train.accumulation no_sync / reduce_scatter / reduce: same losses, one all-reduce per step \
unless reduce, partial sums within 10% ($(lever_error "$TMP/hsdp-reduce_scatter.out" partial_gradient_sums)%)" $ok \
  "$TMP/hsdp-reduce_scatter.out" "$TMP/hsdp-reduce_scatter.err" "$TMP/py.log"

# fsdp.reshard_after_forward_group=2 on 4 ranks (2 simulated nodes of 2): the losses of resharding
# to nothing bit for bit; backward's all-gathers counted inside the groups, the whole group's fewer.
train 4 "$TMP/rg0" "${SMALL[@]}" --steps 3 --metrics "$TMP/rg0.jsonl"
rc_rg0=$RC
train 4 "$TMP/rg2" "${SMALL[@]}" --steps 3 --set fsdp.reshard_after_forward_group=2 --metrics "$TMP/rg2.jsonl"
cat >"$TMP/rg.py" <<'EOF'
import json, sys
def steps(p):
    return [j for j in map(json.loads, open(p)) if not j.get("eval")]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
assert len(a) == len(b) > 0
for x, y in zip(a, b):
    assert x["loss"] == y["loss"], (x["step"], x["loss"], y["loss"])
    assert "group_allgather_bytes" not in x and min(y["group_allgather_bytes"]) > 0, y
    whole = [t - g for t, g in zip(y["allgather_bytes"], y["group_allgather_bytes"])]
    assert all(w < t for w, t in zip(whole, x["allgather_bytes"])), (whole, x["allgather_bytes"])
print("whole-group all-gather", whole[0], "vs", a[-1]["allgather_bytes"][0], "in the node", b[-1]["group_allgather_bytes"][0])
EOF
ok=0
if [ $rc_rg0 -eq 0 ] && [ "$RC" -eq 0 ] && "$PY" "$TMP/rg.py" "$TMP/rg0.jsonl" "$TMP/rg2.jsonl" >"$TMP/py.log" 2>&1 &&
   grep -q "of it inside post-forward groups" "$TMP/rg2.out"; then ok=1; fi
record "fsdp.reshard_after_forward_group=2 on 4 ranks: the same losses bit for bit, $(tail -1 "$TMP/py.log")" $ok \
  "$TMP/rg2.out" "$TMP/rg2.err" "$TMP/py.log"

# lora.replicate_adapters: the adapters whole on every rank, all-reduced: the sharded adapters'
# losses within 1e-5, no adapter gathered.
LORA_SMALL=(--set lora.r=4 --set lora.alpha=8 --set lora.base_dtype=nf4)
train 2 "$TMP/ra0" "${SMALL[@]}" "${LORA_SMALL[@]}" --steps 4 --metrics "$TMP/ra0.jsonl"
rc_ra0=$RC
train 2 "$TMP/ra1" "${SMALL[@]}" "${LORA_SMALL[@]}" --steps 4 --set lora.replicate_adapters=true --metrics "$TMP/ra1.jsonl"
cat >"$TMP/ra.py" <<'EOF'
import json, sys
def steps(p):
    return [j for j in map(json.loads, open(p)) if not j.get("eval")]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
assert len(a) == len(b) > 0
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    assert y["allgather_bytes"][0] < x["allgather_bytes"][0], (x["allgather_bytes"], y["allgather_bytes"])
    assert y["all_reduce_bytes"][0] > x["all_reduce_bytes"][0], (x["all_reduce_bytes"], y["all_reduce_bytes"])
print("all-gather", a[-1]["allgather_bytes"][0], "->", b[-1]["allgather_bytes"][0])
EOF
ok=0
if [ $rc_ra0 -eq 0 ] && [ "$RC" -eq 0 ] && "$PY" "$TMP/ra.py" "$TMP/ra0.jsonl" "$TMP/ra1.jsonl" >"$TMP/py.log" 2>&1; then
  ok=1
fi
record "lora.replicate_adapters: the sharded adapters' losses within 1e-5, $(tail -1 "$TMP/py.log")" $ok \
  "$TMP/ra1.out" "$TMP/ra1.err" "$TMP/py.log"

# A constant schedule after warmup: a run to step 4 then resumed to 6 is one run to step 6.
train 2 "$TMP/sync" "${SMALL[@]}" --set optim.schedule=constant --steps 6 --set train.save_every=2 --save-dir "$TMP/sync-ckpt" \
  --metrics "$TMP/sync.jsonl"
train 2 "$TMP/async" "${SMALL[@]}" --set optim.schedule=constant --steps 4 --set train.save_every=2 --set train.async_save=true \
  --save-dir "$TMP/async-ckpt" --metrics "$TMP/async.jsonl"
rc_a=$RC
train 2 "$TMP/async2" "${SMALL[@]}" --set optim.schedule=constant --steps 6 --set train.save_every=2 --set train.async_save=true \
  --save-dir "$TMP/async-ckpt" --resume latest --metrics "$TMP/async.jsonl"
ok=0
if [ $rc_a -eq 0 ] && [ "$RC" -eq 0 ] && [ -f "$TMP/async-ckpt/step-00000002/train_state.json" ] &&
   [ -f "$TMP/async-ckpt/step-00000006/train_state.json" ] && grep -q "saving checkpoint in the background" "$TMP/async.out" &&
   "$PY" "$TMP/same.py" "$TMP/sync.jsonl" "$TMP/async.jsonl" 1e-6 >"$TMP/py.log" 2>&1 &&
   within10 "$TMP/async.out" async_snapshot; then ok=1; fi
record "async saves: every checkpoint committed by exit, resume gives the synchronous run's losses, \
snapshot within 10% ($(lever_error "$TMP/async.out" async_snapshot)%)" $ok "$TMP/async.out" "$TMP/async2.err" \
  "$TMP/py.log"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
