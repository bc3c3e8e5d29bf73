#!/usr/bin/env python3
"""The NF4 check at a published shape: fsdp's NF4 base decoded plus its LoRA adapters against
transformers + peft on a bitsandbytes NF4 base of the same weights.

A bf16 model of MODEL's shape (bench/configs/MODEL/config.json) with --layers layers and a reduced
vocabulary (--vocab; the embedding and head are bf16 on both sides and take no part in NF4) is made
with transformers' random init, quantized here by bitsandbytes on the CPU (NF4, blocks of 64,
double-quantized absmax, as a "bnb-4bit" Hub checkpoint) and saved; a peft LoRA adapter on the
seven projections (r, alpha as the 8B QLoRA runs: 16, 32) gets random A and B. Then:
  - fsdp (tests/interop/bnb_import_tool: the QLoRA model sharded on one rank, the base in NF4, the
    save imported with its codes as they are, the adapter imported) against bitsandbytes: every NF4
    weight's stored codes and absmax, and its values decoded by fsdp's codec, bit for bit;
  - fsdp's logits (fp32 compute: each gather decodes the NF4 base) against transformers + peft in
    fp32 on bitsandbytes' dequantized weights (the same values, the same arithmetic: tolerance
    1e-5 x max |logit|), and against transformers + peft running the quantized model through
    bitsandbytes' CPU Linear4bit (its product is not fp32's: 2^-5 x max |logit|, the tolerance of a
    side that computes in bf16).
Writes bench/results/nf4-check-MODEL.md and .json with the commit and the conditions.

Usage: .venv/bin/python bench/nf4_check.py [--model llama-3.1-8b] [--layers 2] [--vocab 8192]
         [--tool build/bin/bnb_import_tool] [--out-dir bench/results]
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "interop", "support"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bnb_checks as bc  # noqa: E402

EXACT_TOL, BNB_TOL = 1e-5, 0.03125


def make_base(args, work):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", args.model, "config.json")))
    cfg.update(num_hidden_layers=args.layers, vocab_size=args.vocab, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    path = os.path.join(work, "bf16")
    model.save_pretrained(path)
    return path, cfg


def compare(label, ours, theirs, tol):
    diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    return {"compared": label, "max_abs_diff": diff, "max_abs_logit": scale, "tolerance": tol * max(1.0, scale),
            "argmax_agree": agree, "ok": diff <= tol * max(1.0, scale)}


def run(args, work):
    t0 = time.time()
    bf16, cfg = make_base(args, work)
    q, adapter = os.path.join(work, "q"), os.path.join(work, "adapter")
    bc.quantize(bf16, q)
    bc.random_adapter(bf16, adapter, r=args.r, alpha=args.alpha)
    shutil.rmtree(bf16)
    made = time.time() - t0
    tokens = np.random.default_rng(0).integers(0, args.vocab, args.tokens)
    t1 = time.time()
    rc, out, doc, data = bc.run_tool(args.tool, q, tokens, os.path.join(work, "fsdp"), r=args.r, alpha=args.alpha,
                                     adapter=adapter)
    fsdp_s = time.time() - t1
    if rc != 0:
        raise SystemExit("bnb_import_tool failed:\n" + out)
    quant = bc.load_quantized(q, adapter)
    bad, n = bc.compare_weights(doc, data, bc.bnb_reference(quant, q))  # before quant's first forward
    ours = bc.tool_logits(doc, data)
    rows = [compare("fsdp logits (NF4 base imported as bitsandbytes' codes, decoded by fsdp's codec in each gather; "
                    f"fp32 compute; peft adapter r={args.r}) vs transformers + peft fp32 on bitsandbytes' "
                    f"dequantize_4bit of the same codes, {args.layers} layers", ours,
                    bc.logits_of(bc.dequantized_model(q, adapter), tokens), EXACT_TOL),
            compare("fsdp logits (as above) vs transformers + peft on the bnb-4bit model "
                    f"(bitsandbytes' CPU Linear4bit, compute_dtype fp32), {args.layers} layers", ours,
                    bc.logits_of(quant, tokens), BNB_TOL)]
    return {"model": args.model, "layers": args.layers, "vocab": args.vocab, "shape": {
                k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")},
            "tokens": args.tokens, "lora": {"r": args.r, "alpha": args.alpha},
            "weights": {"nf4_weights": n, "bit_for_bit": not bad, "problems": bad[:10]},
            "logits": rows, "seconds": {"make_and_quantize": round(made, 1), "fsdp_tool": round(fsdp_s, 1),
                                        "total": round(time.time() - t0, 1)}}


def write(args, result):
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    import bitsandbytes
    import peft
    import transformers
    result["commit"] = commit
    result["conditions"] = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, one process; "
                            f"torch {torch.__version__}, transformers {transformers.__version__}, peft "
                            f"{peft.__version__}, bitsandbytes {bitsandbytes.__version__} (CPU backend)")
    base = os.path.join(args.out_dir, f"nf4-check-{args.model}")
    json.dump(result, open(base + ".json", "w"), indent=1)
    w = result["weights"]
    lines = [f"# NF4 check at {args.model}'s shape: fsdp's NF4 base and LoRA against transformers + peft on "
             "bitsandbytes' NF4", "",
             f"Commit {commit}; `{' '.join(['.venv/bin/python', 'bench/nf4_check.py'] + sys.argv[1:])}`; "
             f"{result['conditions']}.", "",
             f"{args.layers} layers of {args.model} (hidden {result['shape']['hidden_size']}, intermediate "
             f"{result['shape']['intermediate_size']}, {result['shape']['num_attention_heads']} heads, "
             f"{result['shape']['num_key_value_heads']} KV heads), vocabulary reduced to {args.vocab} (the "
             "embedding and head stay bf16 on both sides; NF4 covers the seven projections); transformers' "
             "random init in bf16, quantized by bitsandbytes on the CPU (NF4, blocks of 64, double-quantized "
             f"absmax) and saved as a bnb-4bit checkpoint; a peft LoRA adapter (r {args.r}, alpha {args.alpha}) "
             f"with random A and B; {args.tokens} random tokens.", "",
             f"- Weights: {w['nf4_weights']} NF4 weights; fsdp's stored codes and absmax and its decoded values "
             "(fp32, and bf16 against bitsandbytes' own bf16 dequantization) equal bitsandbytes' bit for bit: "
             f"{'yes' if w['bit_for_bit'] else 'NO: ' + '; '.join(w['problems'])}.", "",
             "| compared | max abs diff | max abs logit | tolerance | argmax agrees | ok |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["logits"]:
        lines.append(f"| {r['compared']} | {r['max_abs_diff']:.3g} | {r['max_abs_logit']:.3g} | "
                     f"{r['tolerance']:.3g} | {100 * r['argmax_agree']:.0f}% | {'yes' if r['ok'] else 'NO'} |")
    lines += ["", "Tolerances: 1e-5 x max |logit| where both sides run the same fp32 values in fp32 (only the order "
              "of the sums may differ); 2^-5 x max |logit| against bitsandbytes' CPU Linear4bit, whose product "
              "is not fp32's (the tolerance bench/results uses for a side that computes in bf16).", "",
              f"Seconds: {result['seconds']}."]
    open(base + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return all(r["ok"] for r in result["logits"]) and w["bit_for_bit"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--tool", default=os.path.join(ROOT, "build", "bin", "bnb_import_tool"))
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fsdp-nf4-check-")
    try:
        ok = write(args, run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
