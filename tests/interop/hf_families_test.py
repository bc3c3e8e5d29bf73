#!/usr/bin/env python3
"""Hugging Face import and export for each model family (llama with llama3 rope scaling, qwen2 with
q/k/v biases and tied embeddings, qwen3 with q/k norms and its own head_dim, mistral with a sliding
window shorter than the sequence):

1. transformers builds a small random model and saves it in bf16 across several files;
2. fsdp-train --init-from imports it on 2 ranks (--steps 0 saves the imported weights) and
   fsdp-ckpt logits gives its fp32 logits, which must match transformers' (sdpa, fp32) within
   1e-4, while a negative control (the family's own feature altered) must miss;
3. fine-tuning a few steps from the import on 2 ranks gives the losses of 1 rank;
4. fsdp-ckpt export of the untouched import gives back the original tensors bit for bit (bf16),
   in the family's architecture, and transformers loads it cleanly;
and bad input (no config.json, an unknown model_type, an unsupported rope type, model keys set
beside --init-from, a truncated weight file) fails before the first step naming the file and field.

Usage: FSDP_RUN=... FSDP_TRAIN=... FSDP_CKPT=... hf_families_test.py   (ctest sets all three)
"""
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from hf_checks import load_hf, record, run, summary  # noqa: E402

LOGITS_ATOL = 1e-4
LOSS_RTOL = 2e-5  # 1 rank against 2: the same math, gradients summed in another order
VOCAB = 96
SEQ = 16
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig,
              dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=5)),
}
TRAIN = ["--set", f"data.seq_len={SEQ}", "--set", "train.eval_every=0", "--set", "optim.warmup_steps=1",
         "--set", "optim.lr=1e-3"]

def make_model(family, path):
    """A random bf16 model of `family` saved across several files. Weights are far from transformers'
    init (biases and norm weights included), so each family's feature shapes the logits."""
    cls, extra = FAMILIES[family]
    model = AutoModelForCausalLM.from_config(cls(**SMALL, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def original_tensors(path):
    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def losses(metrics_path):
    out = []
    for line in open(metrics_path):
        rec = json.loads(line)
        if "loss" in rec and "step" in rec and "eval_loss" not in rec:
            out.append(rec["loss"])
    return out


def negative_control(family, model, tokens, ours):
    """The reference with the family's feature altered; must miss our logits by far more than the
    tolerance, or the match proves nothing about that feature."""
    cfg = model.config
    with torch.no_grad():
        if family == "llama":  # unscaled rope instead of llama3's
            cfg2 = transformers.LlamaConfig(**{**SMALL, "rope_parameters": dict(rope_type="default",
                                                                               rope_theta=500000.0)})
            wrong = AutoModelForCausalLM.from_config(cfg2, attn_implementation="sdpa")
            wrong.load_state_dict(model.state_dict())
            what = "rope_type default instead of llama3"
        elif family == "mistral":  # no sliding window
            wrong = AutoModelForCausalLM.from_config(transformers.MistralConfig(**SMALL, sliding_window=None),
                                                     attn_implementation="sdpa")
            wrong.load_state_dict(model.state_dict())
            what = "no sliding window"
        else:
            wrong = model
            name = "q_proj.bias" if family == "qwen2" else "q_norm.weight"
            p = dict(model.named_parameters())["model.layers.0.self_attn." + name]
            saved = p.clone()
            p.add_(0.5)
            what = "layer 0's " + name + " + 0.5"
        miss = float(np.abs(wrong.eval()(torch.from_numpy(tokens)).logits.numpy() - ours).max())
        if family in ("qwen2", "qwen3"):
            p.copy_(saved)
    del cfg
    return what, miss


def family_case(programs, tmp, family):
    root = os.path.join(tmp, family)
    hf_dir, save_dir = os.path.join(root, "hf"), os.path.join(root, "ckpt")
    files = make_model(family, hf_dir)
    record(f"{family}: transformers saved the bf16 model in {len(files)} files", len(files) >= 3, files)

    # 2. Import on 2 ranks; --steps 0 saves exactly the imported weights.
    rc, log = run([programs["FSDP_RUN"], "--nproc-per-node", "2", "--timeout-s", "100", "--", programs["FSDP_TRAIN"],
                   "--init-from", hf_dir, *TRAIN, "--steps", "0", "--save-dir", save_dir])
    record(f"{family}: fsdp-train --init-from on 2 ranks (status {rc})", rc == 0 and "init: " in log, log)
    if rc != 0:
        return
    ckpt = os.path.join(save_dir, "step-00000000")
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 20), dtype=np.int64)
    tokens_path, logits_path = os.path.join(root, "tokens.npy"), os.path.join(root, "logits.npy")
    np.save(tokens_path, tokens)
    rc, log = run([programs["FSDP_CKPT"], "logits", ckpt, tokens_path, logits_path])
    record(f"{family}: fsdp-ckpt logits (status {rc})", rc == 0, log)
    if rc != 0:
        return
    ours = np.load(logits_path)
    model, _, _ = load_hf(hf_dir, "sdpa")
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    diff = float(np.abs(ours - theirs).max()) if ours.shape == theirs.shape else float("inf")
    scale = float(np.abs(theirs).max())
    record(f"{family}: logits match transformers' (fp32, sdpa) within {LOGITS_ATOL}: max abs diff {diff:.2e}, "
           f"max |logit| {scale:.2f}", diff <= LOGITS_ATOL and scale > 100 * LOGITS_ATOL, f"{ours.shape} {theirs.shape}")
    what, miss = negative_control(family, model, tokens, ours)
    record(f"{family}: control ({what}) misses by {miss:.2e} (> {100 * LOGITS_ATOL})", miss > 100 * LOGITS_ATOL)

    if family == "llama":
        # A job script that always passes --resume latest: the first run imports, the next resumes.
        fresh = os.path.join(root, "fresh")
        cmd = [programs["FSDP_TRAIN"], "--init-from", hf_dir, *TRAIN, "--save-dir", fresh, "--resume", "latest"]
        rc1, log1 = run(cmd + ["--steps", "1"])
        rc2, log2 = run(cmd + ["--steps", "2"])
        record("llama: --init-from with --resume latest imports when nothing is saved yet, then resumes",
               rc1 == 0 and "init: " in log1 and rc2 == 0 and "init: " not in log2 and "resumed from" in log2,
               log1 + log2)

    # 3. Fine-tuning from the import: 2 ranks in parity with 1 (the same global batch of 4).
    runs = {}
    for world in (1, 2):
        metrics = os.path.join(root, f"ft{world}.jsonl")
        rc, log = run([programs["FSDP_RUN"], "--nproc-per-node", str(world), "--timeout-s", "100", "--",
                       programs["FSDP_TRAIN"], "--init-from", hf_dir, *TRAIN, "--set",
                       f"data.batch_size_per_rank={4 // world}", "--steps", "4", "--metrics", metrics])
        runs[world] = losses(metrics) if rc == 0 else []
        if rc != 0:
            record(f"{family}: fine-tune on {world} rank(s) (status {rc})", False, log)
    a, b = runs[1], runs[2]
    ok = len(a) == len(b) == 4 and all(abs(x - y) <= LOSS_RTOL * abs(x) for x, y in zip(a, b))
    record(f"{family}: fine-tuning losses on 2 ranks equal 1 rank's (rtol {LOSS_RTOL}): "
           + ", ".join(f"{x:.6f}/{y:.6f}" for x, y in zip(a, b)), ok)

    # 4. Export of the untouched import: the original tensors, bit for bit, in the family's form.
    out_dir = os.path.join(root, "export")
    rc, log = run([programs["FSDP_CKPT"], "export", ckpt, out_dir])
    record(f"{family}: fsdp-ckpt export (default dtype) (status {rc})", rc == 0 and "bfloat16" in log, log)
    if rc != 0:
        return
    orig, back = original_tensors(hf_dir), load_file(os.path.join(out_dir, "model.safetensors"))
    bad = sorted(n for n in orig if n not in back or back[n].dtype != orig[n].dtype or not torch.equal(back[n], orig[n]))
    record(f"{family}: export holds the original {len(orig)} bf16 tensors bit for bit",
           not bad and set(back) == set(orig), f"differ: {bad}\nextra: {sorted(set(back) - set(orig))}")
    config = json.load(open(os.path.join(out_dir, "config.json")))
    exported, info, msgs = load_hf(out_dir, "sdpa")
    problems = {k: sorted(v) for k, v in info.items() if v}
    record(f"{family}: transformers loads the export as {config['architectures']} with no missing, unexpected or "
           "mismatched keys and no warnings",
           config["architectures"] == model.config.architectures and type(exported) is type(model)
           and not problems and not msgs, json.dumps(problems) + "\n" + "\n".join(msgs))
    with torch.no_grad():
        same = float(np.abs(exported(torch.from_numpy(tokens)).logits.numpy() - theirs).max())
    record(f"{family}: the exported model's logits equal the original's (max abs diff {same:.1e})", same == 0.0)
    out32 = os.path.join(root, "export32")
    rc, log = run([programs["FSDP_CKPT"], "export", "--dtype", "float32", ckpt, out32])
    back32 = load_file(os.path.join(out32, "model.safetensors")) if rc == 0 else {}
    ok = rc == 0 and all(back32[n].dtype == torch.float32 and torch.equal(back32[n], t.float()) for n, t in orig.items())
    record(f"{family}: export --dtype float32 holds the same values in fp32 (status {rc})", ok, log)


def bad_input(programs, tmp):
    good = os.path.join(tmp, "llama", "hf")
    train = programs["FSDP_TRAIN"]

    def variant(name, config_patch=None, drop_config=False):
        d = os.path.join(tmp, "bad-" + name)
        shutil.copytree(good, d)
        if drop_config:
            os.remove(os.path.join(d, "config.json"))
        if config_patch:
            cfg = json.load(open(os.path.join(d, "config.json")))
            cfg.update(config_patch)
            json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        return d

    cases = [
        ("no config.json", variant("noconfig", drop_config=True), [], 2, ["has no config.json"]),
        ("unknown model_type", variant("gpt2", {"model_type": "gpt2"}), [], 2,
         ["config.json: model_type=\"gpt2\" is not supported"]),
        ("unsupported rope type", variant("yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                        "rope_theta": 10000.0}}), [], 2,
         ["config.json: rope_parameters.rope_type=\"yarn\" is not supported"]),
        ("unknown option", variant("opt", {"use_qk_layernorm": True}), [], 2, ["config.json: use_qk_layernorm=true"]),
        ("model key beside --init-from", good, ["--set", "model.hidden_size=32"], 2, ["model.hidden_size"]),
    ]
    trunc = variant("trunc")
    shard = sorted(f for f in os.listdir(trunc) if f.endswith(".safetensors"))[-1]
    path = os.path.join(trunc, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    cases.append(("truncated weights", trunc, [], 1, [shard]))
    for what, d, extra, want_rc, needles in cases:
        rc, log = run([train, "--init-from", d, *TRAIN, "--steps", "1", *extra])
        ok = rc == want_rc and all(n in log for n in needles) and "step 1" not in log
        record(f"bad input: {what}: exit {rc}, names it", ok, log)
    rc, log = run([programs["FSDP_CKPT"], "export", "--dtype", "int8", "x", "y"])
    record(f"bad input: export --dtype int8 is a usage error (status {rc})", rc == 2 and "--dtype int8" in log, log)


def main():
    programs = {var: os.environ.get(var, "") for var in ("FSDP_RUN", "FSDP_TRAIN", "FSDP_CKPT")}
    for var, path in programs.items():
        if not path or not os.access(path, os.X_OK):
            print(f"{var} must name the program (ctest sets it), got '{path}'", file=sys.stderr)
            return 2
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            family_case(programs, tmp, family)
        bad_input(programs, tmp)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
