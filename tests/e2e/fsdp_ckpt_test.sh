#!/usr/bin/env bash
# Tests of fsdp-ckpt (apps/fsdp-ckpt/) on real checkpoints: a tiny fsdp-train job on 2 ranks saves at
# steps 2 and 3; then info, verify (clean, and on corrupted copies: truncated file, flipped header byte,
# train_state field removed, optimizer tensor dropped), diff (itself, another step, one flipped data
# byte, --ignore), export (files, refusals) and usage errors are checked.
# Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train FSDP_CKPT=build/bin/fsdp-ckpt \
#          tests/e2e/fsdp_ckpt_test.sh     (ctest sets all three; a few seconds; "N passed, M failed")
set -u

. "$(dirname "${BASH_SOURCE[0]}")/support/record.sh"
require_programs FSDP_RUN FSDP_TRAIN FSDP_CKPT
RUN=$FSDP_RUN
TRAIN=$FSDP_TRAIN
CKPT=$FSDP_CKPT
PY=$(command -v python3 || true)
if [ -z "$PY" ]; then
  echo "python3 is needed to corrupt files and read JSON" >&2
  exit 2
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# ck NAME ARGS...: runs fsdp-ckpt; leaves RC and $TMP/NAME.out (stdout and stderr together).
ck() {
  local name=$1
  shift
  timeout -k 5 60 "$CKPT" "$@" >"$TMP/$name.out" 2>&1 </dev/null
  RC=$?
}

has() { grep -qF -- "$2" "$TMP/$1.out"; }  # has NAME TEXT

# copy NAME: a fresh copy of the step-3 checkpoint at $TMP/NAME.
copy() {
  rm -rf "${TMP:?}/$1"
  cp -r "$TMP/ckpt/step-00000003" "$TMP/$1"
}

# flip FILE OFFSET: XOR one byte with 0x01 (OFFSET < 0 counts from the end).
flip() {
  "$PY" - "$1" "$2" <<'EOF'
import sys
path, off = sys.argv[1], int(sys.argv[2])
data = bytearray(open(path, "rb").read())
data[off] ^= 0x01
open(path, "wb").write(data)
EOF
}

# ---- a checkpoint to look at ---------------------------------------------------------------------
TINY=(--set model.vocab_size=64 --set model.hidden_size=32 --set model.intermediate_size=64
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set data.seq_len=16 --set train.eval_every=0 --set data.batch_size_per_rank=2)
timeout -k 5 120 "$RUN" --nproc-per-node 2 --timeout-s 100 -- "$TRAIN" "${TINY[@]}" --steps 3 \
  --set train.save_every=2 --save-dir "$TMP/ckpt" >"$TMP/train.out" 2>&1 </dev/null
RC=$?
ok=0
if [ "$RC" -eq 0 ] && [ -f "$TMP/ckpt/step-00000002/train_state.json" ] && [ -f "$TMP/ckpt/step-00000003/train_state.json" ]; then
  ok=1
fi
record "fsdp-train on 2 ranks saves step-00000002 and step-00000003 (status $RC)" $ok "$TMP/train.out"
if [ "$ok" != 1 ]; then
  echo "$passed passed, $failed failed"
  exit 1
fi
C3="$TMP/ckpt/step-00000003"
C2="$TMP/ckpt/step-00000002"

# ---- info ----------------------------------------------------------------------------------------
ck info info "$TMP/ckpt"  # the save root: resolved through `latest`
ok=0
if [ "$RC" -eq 0 ] && grep -qE '^  step +3$' "$TMP/info.out" && grep -qE '^  world_size +2$' "$TMP/info.out" &&
   grep -qE '^  strategy +FULL_SHARD$' "$TMP/info.out" && grep -qE '^  samples_seen +12$' "$TMP/info.out" &&
   has info "AdamW (states: exp_avg, exp_avg_sq)" && has info "format_version  1" &&
   grep -qE '^  model\.embed_tokens\.weight +F32 +\[64, 32\] +8192 ' "$TMP/info.out" &&
   has info "total: 63 tensors, 272256 bytes"; then ok=1; fi
record "info on the save root shows step 3, world 2, FULL_SHARD, AdamW, tensors and totals" $ok "$TMP/info.out"

ck info2 info "$C2"
ok=0
if [ "$RC" -eq 0 ] && grep -qE '^  step +2$' "$TMP/info2.out"; then ok=1; fi
record "info on a checkpoint directory shows its own step (2)" $ok "$TMP/info2.out"

# ---- verify --------------------------------------------------------------------------------------
ck verify verify "$C3"
ok=0
if [ "$RC" -eq 0 ] && has verify "ok: 63 tensors, 278592 bytes"; then ok=1; fi
record "verify passes on a fresh checkpoint ($(sed 's/ (.*//' "$TMP/verify.out"))" $ok "$TMP/verify.out"

# expect_verify_failure NAME TEXT...: verify of $TMP/NAME fails (status 1) with every TEXT in its output.
expect_verify_failure() {
  local name=$1 ok=1 text
  shift
  ck "v-$name" verify "$TMP/$name"
  [ "$RC" -eq 1 ] && has "v-$name" "FAILED" || ok=0
  for text in "$@"; do has "v-$name" "$text" || ok=0; done
  record "verify fails on $name, naming $* (status $RC)" $ok "$TMP/v-$name.out"
}

copy truncated
size=$(stat -c %s "$TMP/truncated/model.safetensors")
truncate -s $((size - 100)) "$TMP/truncated/model.safetensors"
expect_verify_failure truncated "$TMP/truncated/model.safetensors"

copy flipped-header
header_len=$("$PY" -c "import struct,sys; print(struct.unpack('<Q', open(sys.argv[1],'rb').read(8))[0])" \
  "$TMP/flipped-header/model.safetensors")
flip "$TMP/flipped-header/model.safetensors" $((8 + header_len / 2))
expect_verify_failure flipped-header "$TMP/flipped-header" "model.safetensors"

copy no-step
"$PY" - "$TMP/no-step/train_state.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1])); del j["step"]; json.dump(j, open(sys.argv[1], "w"))
EOF
expect_verify_failure no-step "train_state.json: field 'step' is missing"

# An optimizer file set without one trainable tensor (index and header rewritten consistently, so
# only the cross-set check can see it).
copy optim-short
"$PY" - "$TMP/optim-short" <<'EOF'
import json, struct, sys
d = sys.argv[1]
path = d + "/optim.exp_avg.safetensors"
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
drop = "model.norm.weight"
b0, b1 = header.pop(drop)["data_offsets"]
data = raw[8 + n:]
data = data[:b0] + data[b1:]
for k, v in header.items():
    if k != "__metadata__" and v["data_offsets"][0] >= b1:
        v["data_offsets"] = [v["data_offsets"][0] - (b1 - b0), v["data_offsets"][1] - (b1 - b0)]
text = json.dumps(header).encode()
text += b" " * ((8 - len(text) % 8) % 8)
open(path, "wb").write(struct.pack("<Q", len(text)) + text + data)
index = json.load(open(path + ".index.json"))
del index["weight_map"][drop]
json.dump(index, open(path + ".index.json", "w"))
EOF
expect_verify_failure optim-short "trainable tensor 'model.norm.weight' (in optimizer.steps) is missing"

ck notckpt verify "$TMP"
ok=0
if [ "$RC" -eq 1 ] && has notckpt "$TMP is not a checkpoint"; then ok=1; fi
record "verify of a directory that is no checkpoint fails naming it (status $RC)" $ok "$TMP/notckpt.out"

# ---- diff ----------------------------------------------------------------------------------------
ck self diff "$C3" "$TMP/ckpt"
ok=0
if [ "$RC" -eq 0 ] && has self "identical: 63 tensors"; then ok=1; fi
record "diff of a checkpoint with itself: status 0 (status $RC)" $ok "$TMP/self.out"

ck steps diff "$C2" "$C3"
ok=0
if [ "$RC" -eq 1 ] && has steps "train_state.json /step: 2 vs 3" && grep -qE "^model: tensor '.*': max abs diff [0-9.e-]+ " "$TMP/steps.out" &&
   has steps "different:"; then ok=1; fi
record "diff of step 2 and step 3: status 1, step and max abs diff shown (status $RC)" $ok "$TMP/steps.out"

copy flipped-data
flip "$TMP/flipped-data/model.safetensors" -1  # the last byte: lm_head.weight's last element
ck data diff "$C3" "$TMP/flipped-data"
ok=0
if [ "$RC" -eq 1 ] && has data "model: tensor 'lm_head.weight': max abs diff" && has data "(1 of 2048 elements differ)" &&
   [ "$(grep -c "tensor '" "$TMP/data.out")" -eq 1 ]; then ok=1; fi
record "diff finds one flipped data byte in lm_head.weight and nothing else (status $RC)" $ok "$TMP/data.out"

copy other-world
"$PY" - "$TMP/other-world/train_state.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1])); j["world_size"] = 4; j["strategy"] = "SHARD_GRAD_OP"; j["rng_states"] *= 2
json.dump(j, open(sys.argv[1], "w"))
EOF
ck world diff "$C3" "$TMP/other-world"
world_rc=$RC
ck world-ignored diff --ignore-world "$C3" "$TMP/other-world"
ok=0
if [ "$world_rc" -eq 1 ] && has world "/world_size: 2 vs 4" && ! has world "rng_states" && [ "$RC" -eq 0 ] &&
   has world-ignored "identical"; then ok=1; fi
record "diff: world_size differs by default, --ignore-world accepts it, rng_states never compared" $ok \
  "$TMP/world.out" "$TMP/world-ignored.out"

ck diff-bad diff "$C3" "$TMP/nope"
ok=0
if [ "$RC" -eq 2 ] && has diff-bad "$TMP/nope is not a checkpoint"; then ok=1; fi
record "diff with a missing checkpoint: status 2, named (status $RC)" $ok "$TMP/diff-bad.out"

# ---- export --------------------------------------------------------------------------------------
ck export export "$TMP/ckpt" "$TMP/hf"
ok=0
if [ "$RC" -eq 0 ] && [ "$(ls "$TMP/hf" | tr '\n' ' ')" = "config.json model.safetensors " ] &&
   "$PY" - "$TMP/hf" >"$TMP/export.check" 2>&1 <<'EOF'; then ok=1; fi
import json, struct, sys
d = sys.argv[1]
c = json.load(open(d + "/config.json"))
assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama", c
assert c["hidden_size"] == 32 and c["num_key_value_heads"] == 2 and c["head_dim"] == 8 and c["hidden_act"] == "silu", c
raw = open(d + "/model.safetensors", "rb").read()
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
assert len(set(header) - {"__metadata__"}) == 21, sorted(header)
EOF
record "export writes config.json and model.safetensors (21 tensors), no index for one file (status $RC)" $ok \
  "$TMP/export.out" "$TMP/export.check"

# Split as transformers' save_pretrained splits: tensors in order, a new file before the one that
# would go over --max-shard-size, a larger tensor alone; model-0000i-of-0000N files and an index.
ck export-split export --max-shard-size 9KB "$TMP/ckpt" "$TMP/hf-split"
ok=0
if [ "$RC" -eq 0 ] && "$PY" - "$TMP/hf" "$TMP/hf-split" >"$TMP/export-split.check" 2>&1 <<'EOF'; then ok=1; fi
import json, os, struct, sys
def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in header.items()}
    return data, len(raw) - 8 - n
one, one_bytes = tensors(sys.argv[1] + "/model.safetensors")
d = sys.argv[2]
index = json.load(open(d + "/model.safetensors.index.json"))
files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
n = len(files)
assert n > 2 and files == ["model-%05d-of-%05d.safetensors" % (i, n) for i in range(1, n + 1)], files
assert sorted(os.listdir(d)) == ["config.json"] + files + ["model.safetensors.index.json"], os.listdir(d)
assert index["metadata"]["total_size"] == one_bytes, (index["metadata"], one_bytes)
merged, order = {}, []
for f in files:
    t, data = tensors(d + "/" + f)
    assert data <= 9000 or len(t) == 1, (f, data, list(t))
    assert all(index["weight_map"][k] == f for k in t), f
    merged.update(t)
    order += sorted(t, key=lambda k: list(one).index(k))
assert merged == one, "the split files hold other bytes than the single file"
print(n, "files")
EOF
record "export --max-shard-size 9KB splits into model-0000i-of-0000N files, same bytes, index (status $RC)" $ok \
  "$TMP/export-split.out" "$TMP/export-split.check"
ck export-badsize export --max-shard-size 2.5GB "$TMP/ckpt" "$TMP/hf-bad"
ok=0
if [ "$RC" -eq 2 ] && has export-badsize "max-shard-size 2.5GB" && [ ! -e "$TMP/hf-bad" ]; then ok=1; fi
record "export --max-shard-size 2.5GB: usage error, nothing written (status $RC)" $ok "$TMP/export-badsize.out"

ck export-again export "$C3" "$TMP/hf"
ok=0
if [ "$RC" -eq 1 ] && has export-again "$TMP/hf is not empty"; then ok=1; fi
record "export into a non-empty directory is refused (status $RC)" $ok "$TMP/export-again.out"

copy no-config
"$PY" - "$TMP/no-config/train_state.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1])); j["extra"] = {}; json.dump(j, open(sys.argv[1], "w"))
EOF
ck export-noconfig export "$TMP/no-config" "$TMP/hf2"
ok=0
if [ "$RC" -eq 1 ] && has export-noconfig "has no model config (extra.config.model)" && [ ! -e "$TMP/hf2" ]; then ok=1; fi
record "export of a checkpoint without a model config fails naming it, writes nothing (status $RC)" $ok \
  "$TMP/export-noconfig.out"

# ---- usage ---------------------------------------------------------------------------------------
usage_ok=1
for args in "" "frobnicate $C3" "diff $C3" "export $C3" "info" "diff --max-diffs x $C3 $C3"; do
  # shellcheck disable=SC2086
  ck usage $args
  if [ "$RC" -ne 2 ] || ! has usage "usage"; then
    usage_ok=0
    echo "    | fsdp-ckpt $args: status $RC"
  fi
done
record "usage errors exit 2 with the usage text" $usage_ok "$TMP/usage.out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
