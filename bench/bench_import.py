#!/usr/bin/env python3
"""Peak RSS per rank while fsdp-train imports a Hugging Face model (`--init-from`), against the
model's size and the shard's size.

transformers builds a Llama from a config (random init, bf16, >= 1 GiB of weights) and saves it
across several files; the model is deleted before fsdp-train runs. Then, on N ranks (default 2):
  baseline  fsdp-train --init-only: each rank's peak RSS with the libraries loaded and the job
            joined, no model;
  import    fsdp-train --init-from DIR --steps 0 (no checkpoint): each rank builds the model on the
            meta device, shards it, and reads only its shards' byte ranges, converting bf16 to its
            fp32 master shard on the fly.
import - baseline is what importing costs a rank; the fp32 master shard (the model's parameters x 4
bytes / N) is the floor, the whole model in bf16 and in fp32 what a rank holding the model would
need. Results: bench/results/import.json and import.md.

Usage: bench/bench_import.py [--ranks N] [--layers L] [--out-dir bench/results]   (the venv's python)
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GIB = 2**30


def build_model(path, layers):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size="400MB")
    del model
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    weight_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    return params, files, weight_bytes


def peak_rss(metrics_path):
    """Per-rank peak RSS from fsdp-train's --metrics (the init-only line or the last step line)."""
    lines = [json.loads(line) for line in open(metrics_path) if line.strip()]
    return lines[-1]["peak_rss_bytes"]


def run(cmd):
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit(f"bench_import: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}")
    return p.stdout, time.monotonic() - t0


def rss_from_log(log):
    m = re.search(r"peak RSS per rank:((?: [0-9.]+ MiB)+)", log)
    return [float(x) * 2**20 for x in re.findall(r"([0-9.]+) MiB", m.group(1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--bin", default="build/bin")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-import-")
    try:
        hf = os.path.join(tmp, "hf")
        params, files, weight_bytes = build_model(hf, args.layers)
        launch = [os.path.join(args.bin, "fsdp-run"), "--nproc-per-node", str(args.ranks), "--timeout-s", "600", "--",
                  os.path.join(args.bin, "fsdp-train"), "--init-from", hf]
        base_metrics = os.path.join(tmp, "base.jsonl")
        run(launch + ["--init-only", "--metrics", base_metrics])
        baseline = peak_rss(base_metrics)
        log, seconds = run(launch + ["--steps", "0"])
        peak = rss_from_log(log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    shard = params * 4 / args.ranks
    result = {
        "ranks": args.ranks, "params": params, "files": len(files), "weights_bf16_bytes": weight_bytes,
        "model_fp32_bytes": params * 4, "fp32_shard_bytes": shard, "baseline_peak_rss_bytes": baseline,
        "import_peak_rss_bytes": peak, "import_above_baseline_bytes": [p - b for p, b in zip(peak, baseline)],
        "import_wall_s": seconds,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "import.json"), "w") as f:
        json.dump(result, f, indent=1)
    mib = lambda x: f"{x / 2**20:,.0f} MiB"  # noqa: E731
    rows = [f"| {r} | {mib(b)} | {mib(p)} | {mib(p - b)} | {(p - b) / shard:.3f} | {(p - b) / weight_bytes:.3f} |"
            for r, (b, p) in enumerate(zip(baseline, peak))]
    md = [
        f"Import of a Hugging Face Llama (transformers, random init, bf16: {params / 1e6:.0f}M parameters, "
        f"{weight_bytes / GIB:.2f} GiB of weights in {len(files)} files) by `fsdp-train --init-from DIR --steps 0` "
        f"on {args.ranks} ranks (CPU), {seconds:.1f} s for the whole run.",
        f"Sizes: the model {weight_bytes / GIB:.2f} GiB in bf16, {params * 4 / GIB:.2f} GiB in fp32; one rank's fp32 "
        f"master shard {shard / GIB:.2f} GiB. Baseline: `--init-only` (libraries loaded, job joined, no model).",
        "",
        "| rank | baseline peak RSS | import peak RSS | import - baseline | / fp32 shard | / bf16 model |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Measured by `bench/bench_import.py` (`scripts/bench import`).",
    ]
    with open(os.path.join(args.out_dir, "import.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
