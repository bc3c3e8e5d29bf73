#!/usr/bin/env bash
# fsdp-plan takes what it is given, or refuses it by name (status 2), within seconds:
#  - with --hf-config, a choice a --set names (fsdp.strategy, fsdp.offload.*) is kept, not
#    replaced by the planner's; a key that a flag owns (fsdp.device, the budgets) is refused; a key
#    no figure depends on is noted;
#  - --config takes a published config.json as its model section;
#  - sizes out of range (a vocabulary of 1e17, 2^40 layers), a missing required size, a size
#    without a unit are refused naming them;
#  - a margin (10% of the device unless --margin) is held free when choosing, and printed.
# Usage: FSDP_PLAN=... tests/e2e/plan_cli_test.sh (ctest sets it; about 10 s)
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/support/record.sh"
require_programs FSDP_PLAN
scratch_dir plan-cli
PLAN=(timeout -k 5 60 "$FSDP_PLAN")

# Qwen2.5-0.5B's published config.json; $1 = extra "key": value pairs laid over it.
qwen() {
  python3 - "$1" <<'EOF'
import json, sys
c = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
     "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
     "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
     "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
     "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
     "use_cache": True, "use_sliding_window": False, "use_mrope": False, "vocab_size": 151936}
c.update(json.loads("{" + sys.argv[1] + "}"))
print(json.dumps({k: v for k, v in c.items() if v != "DROP"}))
EOF
}
qwen "" >"$TMP/qwen.json"
BASE=(--hf-config "$TMP/qwen.json" --nproc-per-node 2 --host-memory 16GB --disk 100GB --seq-len 128)

# ---- --set choices are kept ------------------------------------------------------------------------
"${PLAN[@]}" "${BASE[@]}" --set fsdp.strategy=NO_SHARD >"$TMP/noshard.out" 2>&1
rc=$?
ok=0
[ $rc -eq 0 ] && grep -q "^fits: NO_SHARD over 1 rank(s)" "$TMP/noshard.out" && ok=1
record "--hf-config with --set fsdp.strategy=NO_SHARD plans NO_SHARD (rc $rc)" $ok "$TMP/noshard.out"

"${PLAN[@]}" "${BASE[@]}" --set fsdp.offload.optimizer_state=disk --set "fsdp.offload.dir=$TMP/tier" >"$TMP/disk.out" 2>&1
rc=$?
ok=0
[ $rc -eq 0 ] && grep -q "optimizer_state disk" "$TMP/disk.out" && grep -q "sharded states in the disk tier" "$TMP/disk.out" &&
  ok=1
record "--hf-config with --set fsdp.offload.optimizer_state=disk keeps the disk tier (rc $rc)" $ok "$TMP/disk.out"

"${PLAN[@]}" "${BASE[@]}" --set fsdp.device=cuda >"$TMP/owned.out" 2>&1
rc1=$?
"${PLAN[@]}" "${BASE[@]}" --set train.budget.host_bytes=1000 >>"$TMP/owned.out" 2>&1
rc2=$?
ok=0
[ $rc1 -eq 2 ] && [ $rc2 -eq 2 ] && grep -q "fsdp.device=cuda: give it as --device instead" "$TMP/owned.out" &&
  grep -q "train.budget.host_bytes=1000: give it as --host-memory instead" "$TMP/owned.out" && ok=1
record "a --set that a flag owns is refused naming the flag (rc $rc1, $rc2)" $ok "$TMP/owned.out"

"${PLAN[@]}" "${BASE[@]}" --set optim.lr=0.5 >"$TMP/note.out" 2>"$TMP/note.err"
rc=$?
ok=0
[ $rc -eq 0 ] && grep -q "note: --set optim.lr=0.5 applies to the run, but no figure of its plan depends on it" \
  "$TMP/note.err" && ok=1
record "a --set no figure depends on is noted (rc $rc)" $ok "$TMP/note.err"

"${PLAN[@]}" "${BASE[@]}" --set fsdp.strategy=NO_SHRAD >"$TMP/badkey.out" 2>&1
rc1=$?
"${PLAN[@]}" "${BASE[@]}" --set fsdp.stratgy=NO_SHARD >>"$TMP/badkey.out" 2>&1
rc2=$?
ok=0
[ $rc1 -eq 2 ] && [ $rc2 -eq 2 ] && grep -q "fsdp.strategy=\"NO_SHRAD\"" "$TMP/badkey.out" &&
  grep -q "fsdp.stratgy" "$TMP/badkey.out" && ok=1
record "a bad --set value or key is refused naming it (rc $rc1, $rc2)" $ok "$TMP/badkey.out"

# ---- --config takes a published config.json as its model section -----------------------------------
python3 -c "import json,sys; print(json.dumps({'model': json.load(open(sys.argv[1]))}))" "$TMP/qwen.json" \
  >"$TMP/train.json"
"${PLAN[@]}" --config "$TMP/train.json" --nproc-per-node 2 --host-memory 16GB --disk 100GB >"$TMP/config.out" 2>&1
rc=$?
ok=0
[ $rc -eq 0 ] && grep -q "model: qwen2, 24 layers, hidden 896, vocab 151936" "$TMP/config.out" && ok=1
record "--config with a published config.json as its model section plans it (rc $rc)" $ok "$TMP/config.out"

# ---- sizes out of range, missing, without a unit ---------------------------------------------------
refused() {  # refused NAME EXPECTED-TEXT ARGS...: status 2 in under a minute, the text in the output
  local name=$1 want=$2
  shift 2
  "${PLAN[@]}" "$@" >"$TMP/r.out" 2>&1
  local rc=$?
  local ok=0
  [ $rc -eq 2 ] && grep -qF -- "$want" "$TMP/r.out" && ok=1
  record "$name (rc $rc)" $ok "$TMP/r.out"
}
qwen '"vocab_size": 100000000000000000' >"$TMP/vocab.json"
refused "a vocabulary of 1e17 is refused, not planned" "vocab_size=100000000000000000 is out of range" \
  --hf-config "$TMP/vocab.json" --host-memory 16GB --disk 1TB
qwen '"num_hidden_layers": 1099511627776' >"$TMP/layers.json"
refused "2^40 layers are refused at once" "num_hidden_layers=1099511627776 is out of range" \
  --hf-config "$TMP/layers.json" --host-memory 16GB --disk 1TB
qwen '"hidden_size": "DROP"' >"$TMP/nohidden.json"
refused "a config.json without hidden_size is refused" "has no hidden_size" \
  --hf-config "$TMP/nohidden.json" --host-memory 16GB --disk 1TB
refused "a size without a unit is refused" "--device-memory 24: a size needs a unit: 24GB, 24GiB, or 24B" \
  "${BASE[@]}" --device cuda --device-memory 24
refused "a size past 1 EiB is refused" "out of range" "${BASE[@]}" --device cuda --device-memory 1e30GB
refused "a margin past 90% is refused" "--margin 95%" "${BASE[@]}" --margin 95%

# ---- the margin ----------------------------------------------------------------------------------
# The fastest choice's total at no margin; a budget 5% above it fits with --margin 0%, and at the
# default 10% the plan holds 10% free: it takes a cheaper choice, or does not fit.
"${PLAN[@]}" "${BASE[@]}" --margin 0% >"$TMP/m0.out" 2>&1
total=$(sed -n 's/^memory (RAM) per rank: \([0-9.]*\) MiB.*/\1/p' "$TMP/m0.out")
budget=$(python3 -c "print(int(float('$total') * 1.05 * 2**20))")
"${PLAN[@]}" "${BASE[@]/16GB/${budget}B}" --margin 0% >"$TMP/m0b.out" 2>&1
rc0=$?
"${PLAN[@]}" "${BASE[@]/16GB/${budget}B}" >"$TMP/m10.out" 2>&1
rc10=$?
ok=0
[ -n "$total" ] && [ $rc0 -eq 0 ] && ! grep -q "margin held free" "$TMP/m0b.out" &&
  grep -q "margin held free: " "$TMP/m10.out" && ! cmp -s "$TMP/m0b.out" "$TMP/m10.out" &&
  python3 - "$TMP/m10.out" "$budget" $rc10 <<'EOF' && ok=1
import re, sys
out, budget, rc = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3])
total = float(re.search(r"^memory \(RAM\) per rank: ([0-9.]+) MiB", out, re.M).group(1)) * 2**20
margin = float(re.search(r"margin held free: ([0-9.]+) MiB", out).group(1)) * 2**20
assert abs(margin - 0.10 * budget) < 2**20, (margin, budget)
if rc == 0:
    assert total <= budget - margin + 2**20, (total, budget, margin)
else:
    assert rc == 1 and "host less the margin" in out, out
EOF
record "the default 10% margin is held free when choosing and printed (plain total $total MiB, rc $rc0 then $rc10)" \
  $ok "$TMP/m0b.out" "$TMP/m10.out"

# The load and the save as phases: --load and --save choose them; a bad value is a usage error.
"${PLAN[@]}" "${BASE[@]}" --load resume --save no >"$TMP/phases.out" 2>&1
rc=$?
"${PLAN[@]}" "${BASE[@]}" --save maybe >"$TMP/phases-bad.out" 2>&1
rc_bad=$?
ok=0
[ $rc -eq 0 ] && grep -q "^the load (resume) per rank: " "$TMP/phases.out" && ! grep -q "^a save per rank" "$TMP/phases.out" &&
  grep -q "^peak per rank: .* in the step" "$TMP/phases.out" && [ $rc_bad -eq 2 ] &&
  grep -q "\-\-save maybe: yes or no" "$TMP/phases-bad.out" && ok=1
record "fsdp-plan --load resume --save no plans a resume and no save; --save maybe is refused" $ok "$TMP/phases.out" \
  "$TMP/phases-bad.out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
