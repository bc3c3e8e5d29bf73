#!/usr/bin/env python3
"""Hugging Face interop of fsdp-ckpt export: a checkpoint of fsdp-train's Llama, exported, loads in
transformers' LlamaForCausalLM with no missing, unexpected or mismatched keys and no warnings, holds
the checkpoint's tensors bit for bit, and gives the logits that the same checkpoint gives in
LibTorch (fsdp-ckpt logits, the unsharded llama::LlamaForCausalLM) within 1e-4 in fp32.

Run for tied and untied embeddings, each trained a few steps on 2 ranks so that the weights are not
the initial ones.

Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train FSDP_CKPT=build/bin/fsdp-ckpt \\
         hf_interop_test.py    (the venv's python; ctest sets all three; "N passed, M failed")
"""
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from hf_checks import load_hf, record, run, summary  # noqa: E402

LOGITS_ATOL = 1e-4  # fp32, the same math in two implementations
VOCAB = 64
TINY = [
    "--set", f"model.vocab_size={VOCAB}", "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64",
    "--set", "model.num_hidden_layers=2", "--set", "model.num_attention_heads=4",
    "--set", "model.num_key_value_heads=2", "--set", "model.rope_theta=500",
    "--set", "data.seq_len=16", "--set", "data.batch_size_per_rank=2", "--set", "train.eval_every=0",
    "--set", "optim.warmup_steps=1",
    # Weights well away from zero, so that attention (and with it the rope base) shapes the logits.
    "--set", "model.initializer_range=0.3",
]
STEPS = 4

def case(programs, tmp, tie):
    label = "tied" if tie else "untied"
    root = os.path.join(tmp, label)
    save_dir, out_dir = os.path.join(root, "ckpt"), os.path.join(root, "hf")
    rc, log = run([programs["FSDP_RUN"], "--nproc-per-node", "2", "--timeout-s", "100", "--",
                   programs["FSDP_TRAIN"], *TINY,
                   "--set", "model.tie_word_embeddings=" + ("true" if tie else "false"),
                   "--steps", str(STEPS), "--save-dir", save_dir])
    record(f"{label}: fsdp-train on 2 ranks saves a checkpoint (status {rc})", rc == 0, log)
    if rc != 0:
        return
    ckpt = os.path.join(save_dir, "step-%08d" % STEPS)

    rc, log = run([programs["FSDP_CKPT"], "export", save_dir, out_dir])
    files = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    ok = rc == 0 and files == ["config.json", "model.safetensors"]  # one file: no index, as transformers
    record(f"{label}: fsdp-ckpt export writes {files} (status {rc})", ok, log)
    if not ok:
        return

    try:
        model, info, msgs = load_hf(out_dir, "eager", LlamaForCausalLM)
    except Exception as e:  # noqa: BLE001 - reported as a failure
        record(f"{label}: LlamaForCausalLM.from_pretrained loads the export", False, repr(e))
        return
    problems = {k: sorted(v) for k, v in info.items() if v}
    record(f"{label}: from_pretrained: no missing, unexpected or mismatched keys, no warnings",
           not problems and not msgs, json.dumps(problems, indent=1) + "\n" + "\n".join(msgs))

    config_ok = (model.config.tie_word_embeddings == tie and model.config.num_key_value_heads == 2
                 and model.config.hidden_act == "silu" and model.config.rope_parameters["rope_theta"] == 500)
    tied_ok = (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tie
    record(f"{label}: config read back (GQA 4/2, rope_theta 500, silu); lm_head tied to the embedding: {tie}",
           config_ok and tied_ok, model.config)

    # Every tensor as in the checkpoint, bit for bit (the tied lm_head is the embedding).
    saved = load_file(os.path.join(ckpt, "model.safetensors"))
    state = model.state_dict()
    mismatched = [n for n, t in saved.items() if n not in state or not torch.equal(state[n], t)]
    if tie:
        mismatched += [] if torch.equal(state["lm_head.weight"], saved["model.embed_tokens.weight"]) else ["lm_head"]
    expected = set(state) - ({"lm_head.weight"} if tie else set())
    record(f"{label}: the loaded weights equal the checkpoint's {len(saved)} tensors bit for bit",
           not mismatched and set(saved) == expected,
           "mismatched: %s\nonly in HF: %s" % (mismatched, sorted(expected - set(saved))))

    tokens = np.random.default_rng(7).integers(0, VOCAB, size=(3, 24), dtype=np.int64)
    tokens_path, logits_path = os.path.join(root, "tokens.npy"), os.path.join(root, "logits.npy")
    np.save(tokens_path, tokens)
    rc, log = run([programs["FSDP_CKPT"], "logits", ckpt, tokens_path, logits_path])
    record(f"{label}: fsdp-ckpt logits (status {rc})", rc == 0, log)
    if rc != 0:
        return
    ours = np.load(logits_path)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ok = ours.shape == theirs.shape == (3, 24, VOCAB) and ours.dtype == np.float32
    diff = float(np.abs(ours - theirs).max()) if ok else float("inf")
    scale = float(np.abs(theirs).max())
    # A non-trivial comparison: the logits are far from zero and the tolerance is far below their
    # spread across tokens.
    ok = ok and diff <= LOGITS_ATOL and scale > 100 * LOGITS_ATOL
    print(f"{label}: max abs logits difference HF vs fsdp: {diff:.3e} (max |logit| {scale:.3f}, tolerance {LOGITS_ATOL})")
    record(f"{label}: HF logits match fsdp's within {LOGITS_ATOL} (max abs diff {diff:.3e})", ok,
           f"shapes {ours.shape} {theirs.shape}, dtype {ours.dtype}")

    # Split into several files (--max-shard-size, as save_pretrained splits), the export loads to the
    # same logits, bit for bit.
    split_dir = os.path.join(root, "hf-split")
    rc, log = run([programs["FSDP_CKPT"], "export", "--max-shard-size", "20KB", save_dir, split_dir])
    shards = sorted(f for f in os.listdir(split_dir) if f.endswith(".safetensors")) if rc == 0 else []
    index_ok = rc == 0 and os.path.exists(os.path.join(split_dir, "model.safetensors.index.json"))
    record(f"{label}: export --max-shard-size 20KB writes {len(shards)} files and an index (status {rc})",
           index_ok and len(shards) > 2 and shards[0] == "model-00001-of-%05d.safetensors" % len(shards), log)
    if index_ok:
        split, info, msgs = load_hf(split_dir, "eager", LlamaForCausalLM)
        with torch.no_grad():
            split_logits = split(torch.from_numpy(tokens)).logits
            one_logits = model(torch.from_numpy(tokens)).logits
        problems = {k: sorted(v) for k, v in info.items() if v}
        record(f"{label}: the split export loads with no missing or unexpected keys, to the same logits bit for bit",
               not problems and not msgs and torch.equal(split_logits, one_logits),
               json.dumps(problems) + "\n" + "\n".join(msgs))

    # Negative control: the same weights under transformers' default rope base (10000 instead of the
    # trained 500) must miss by far more than the tolerance, or the comparison above proves nothing
    # about the config conversion.
    control_dir = os.path.join(root, "hf-rope-default")
    os.makedirs(control_dir)
    os.link(os.path.join(out_dir, "model.safetensors"), os.path.join(control_dir, "model.safetensors"))
    config = json.load(open(os.path.join(out_dir, "config.json")))
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = 10000.0
    json.dump(config, open(os.path.join(control_dir, "config.json"), "w"))
    control, _, _ = load_hf(control_dir, "eager", LlamaForCausalLM)
    with torch.no_grad():
        wrong = float(np.abs(control(torch.from_numpy(tokens)).logits.numpy() - ours).max())
    record(f"{label}: control: with rope_theta 10000 the logits miss by {wrong:.3e} (> {100 * LOGITS_ATOL})",
           wrong > 100 * LOGITS_ATOL)


def main():
    if len(sys.argv) != 1:
        print("\n".join(__doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    programs = {var: os.environ.get(var, "") for var in ("FSDP_RUN", "FSDP_TRAIN", "FSDP_CKPT")}
    for var, path in programs.items():
        if not path:
            print(f"{var} is not set (the program's path, e.g. {var}=build/bin/...; ctest sets it)",
                  file=sys.stderr)
            return 2
        if not os.access(path, os.X_OK):
            print(f"not an executable: {path}", file=sys.stderr)
            return 2
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        for tie in (True, False):
            case(programs, tmp, tie)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
