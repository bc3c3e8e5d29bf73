#!/usr/bin/env python3
"""LoRA against a full fine-tune at a published model's size (scripts/bench lora).

One model (default Qwen2.5-0.5B, built by transformers from its published config with random bf16
weights, as bench/scale.py does), imported by fsdp-train on 2 ranks through fsdp-run, bf16 compute
with fp32 reduction, AdamW, seq_len 128, 1 sample per rank per step, the same token file, nothing
offloaded, each run in fresh processes with OMP_NUM_THREADS=1:

  full        every parameter trained: fp32 masters, gradients and AdamW state
  lora-bf16   LoRA r=16 alpha=32 on q,k,v,o,gate,up,down; the frozen base kept in bf16 shards
  lora-int8   the same, the targets' weights in int8 blocks (the rest of the base in bf16)
  lora-nf4    the same, the targets' weights in NF4 blocks

Per run: the peak RSS per rank over the whole process (import included) and over the training
steps, the median step time of steps 2 to N, fsdp-train's plan for the run (device bytes per rank),
the losses. Then the ratios against `full`, and bench/lora_parity.py on the same model (fp32
compute, 5 steps: fsdp's LoRA losses against peft + transformers). Writes bench/results/lora-MODEL.md
and .json.

Usage: .venv/bin/python bench/lora_bench.py [--model qwen2.5-0.5b] [--steps 6] [--bin build/bin]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from scale import MODELS, build_model  # noqa: E402

MIB = 2**20
LORA = ["--set", "lora.r=16", "--set", "lora.alpha=32"]
CKPT = ["--set", "train.activation_checkpointing=1"]
RUNS = {
    "full": [],
    "lora-bf16": LORA + ["--set", "lora.base_dtype=bfloat16"],
    "lora-int8": LORA + ["--set", "lora.base_dtype=int8"],
    "lora-nf4": LORA + ["--set", "lora.base_dtype=nf4"],
    # The same NF4 run with the embedding and the head gathered as before vocab-parallel tables.
    "lora-nf4-gathered": LORA + ["--set", "lora.base_dtype=nf4", "--set", "fsdp.vocab_parallel=off"],
    # Activation checkpointing on both sides of the comparison.
    "full-ckpt": CKPT,
    "lora-nf4-ckpt": LORA + ["--set", "lora.base_dtype=nf4"] + CKPT,
}
GOALS = {"lora-bf16": 0.35, "lora-nf4": 0.15, "lora-nf4-ckpt": 0.15}  # peak RSS per rank against the full fine-tune's


def baseline_of(name):
    """The full fine-tune a run is compared with: the one with the same activation checkpointing."""
    return "full-ckpt" if name.endswith("-ckpt") else "full"


def model_and_tokens(work, model):
    """The model's HF directory (random bf16 weights, bench/scale.py) and a token file of 1M uint32
    tokens under `work`: (hf, tokens, params)."""
    import numpy as np
    spec, shard_size, drop = MODELS[model]
    hf = os.path.join(work, "hf")
    params, _, _ = build_model(hf, spec, shard_size, drop, seed=0)
    tokens = os.path.join(work, "train.bin")
    np.random.default_rng(0).integers(0, spec["vocab_size"], size=1 << 20, dtype=np.uint32).tofile(tokens)
    return hf, tokens, params


def train_run(args, name, extra, hf, tokens, work):
    metrics = os.path.join(work, f"{name}.jsonl")
    cmd = [os.path.join(args.bin, "fsdp-run"), "--nproc-per-node", "2", "--timeout-s", "3600", "--",
           os.path.join(args.bin, "fsdp-train"), "--init-from", hf, "--steps", str(args.steps),
           "--set", "data.source=file", "--set", f"data.path={tokens}", "--set", "data.token_dtype=uint32",
           "--set", f"data.seq_len={args.seq_len}", "--set", "data.batch_size_per_rank=1",
           "--set", "fsdp.param_dtype=bfloat16", "--set", "fsdp.reduce_dtype=float32",
           "--set", "train.eval_every=0", "--set", "train.log_every=1", "--set", "fsdp.timeout_s=600",
           "--metrics", metrics, *extra]
    print(f"lora_bench: {name}", flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        raise SystemExit(f"lora_bench: {name} failed (status {p.returncode}):\n{p.stdout[-3000:]}")
    steps = [json.loads(line) for line in open(metrics) if '"eval' not in line]
    whole = re.search(r"peak RSS per rank: ([\d.]+) MiB ([\d.]+) MiB", p.stdout.split("done:")[-1])
    plan = re.search(r"memory (?:\(RAM\) )?per rank: ([\d.]+) MiB", p.stdout)
    trainable = re.search(r"params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+) MiB", p.stdout)
    return {
        "name": name,
        "peak_rss_process_mib": [float(whole.group(1)), float(whole.group(2))] if whole else None,
        "peak_rss_steps_mib": [max(s["peak_rss_bytes"][r] for s in steps) / MIB for r in (0, 1)],
        "step_time_s": statistics.median(s["step_time_s"] for s in steps[1:]),
        "plan_device_mib": float(plan.group(1)) if plan else None,
        "sharded_mib": [float(x) for x in trainable.groups()] if trainable else None,
        "losses": [s["loss"] for s in steps],
    }


def report(r):
    lines = [f"# LoRA against a full fine-tune: {r['model']} ({r['params'] / 1e6:.1f}M parameters)", "",
             f"- Commit: {r.get('commit', '?')}.",
             "- Machine: this one, 2 cores, 23.5 GiB of RAM, no GPU.",
             "- Threads: `OMP_NUM_THREADS=1`, one intra-op thread per rank. Transport: shared memory.",
             "- Page cache: warm (the model directory and the token file written just before the runs).",
             f"- Quiet: {r.get('quiet', 'not recorded')}.", "",
             f"Command: `{r['command']}`", "",
             "Conditions: this machine (2 cores), 2 ranks through fsdp-run (shared-memory transport), "
             "OMP_NUM_THREADS=1, bf16 compute with fp32 reduction, AdamW, seq_len "
             f"{r['seq_len']}, 1 sample per rank per step, {r['steps']} steps, nothing offloaded; LoRA r=16 "
             "alpha=32 on q,k,v,o,gate,up,down, the embedding and the head vocab-parallel tables (fsdp.vocab_parallel "
             "auto) except in lora-nf4-gathered; -ckpt runs checkpoint every layer's activations and are compared "
             "with full-ckpt, the others with full. Peak RSS: VmHWM of each rank's process (import included) and "
             "the largest per-step peak (fsdp-train's metrics). Step time: median of steps 2 to N.", "",
             "| run | peak RSS per rank, process (MiB) | over the steps (MiB) | / full (process) | plan, device per rank "
             "(MiB) | steps / plan | step time (s) | / full | sharded params, grads, optimizer (MiB, rank 0) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        # Its baseline (full or full-ckpt), when this invocation ran it (--runs may leave it out).
        full = r["runs"].get(baseline_of(name)) or r["runs"].get("full")
        proc = max(run["peak_rss_process_mib"])
        steps = max(run["peak_rss_steps_mib"])
        goal = GOALS.get(name)
        if full:
            ratio = proc / max(full["peak_rss_process_mib"])
            mark = f" (goal <= {goal}: {'met' if ratio <= goal else 'missed'})" if goal else ""
            vs_full, time_vs_full = f"{ratio:.3f}{mark}", f"{run['step_time_s'] / full['step_time_s']:.2f}"
        else:
            vs_full, time_vs_full = "baseline not run", "-"
        plan = run["plan_device_mib"]
        lines.append(
            f"| {name} | {run['peak_rss_process_mib'][0]:,.0f} / {run['peak_rss_process_mib'][1]:,.0f} | "
            f"{run['peak_rss_steps_mib'][0]:,.0f} / {run['peak_rss_steps_mib'][1]:,.0f} | {vs_full} | "
            f"{plan:,.0f} | {steps / plan:.2f} | {run['step_time_s']:.2f} | "
            f"{time_vs_full} | {', '.join(f'{x:,.1f}' for x in run['sharded_mib'])} |")
    lines += ["", "Losses (step 1 .. N):", ""]
    for name, run in r["runs"].items():
        lines.append(f"- {name}: " + ", ".join(f"{x:.4f}" for x in run["losses"]))
    par = r.get("parity")
    if par:
        lines += ["", "## LoRA losses against peft + transformers (bench/lora_parity.py)", "",
                  "fp32 compute, bf16 base (fsdp: frozen bf16 shards, no fp32 master), r=8 alpha=16 from a peft "
                  "adapter with init_lora_weights=False, 2 ranks against one unsharded process, 5 steps, seq_len 64, "
                  "2 samples per step.", "", "| step | fsdp-train | peft + transformers | abs diff |",
                  "| --- | --- | --- | --- |"]
        for i, (a, b) in enumerate(zip(par["fsdp"], par["reference"])):
            lines.append(f"| {i + 1} | {a:.8f} | {b:.8f} | {abs(a - b):.2e} |")
        lines.append(f"\nmax abs diff {par['max_abs_diff']:.2e} (goal <= {par['tol']:g}): "
                     f"{'met' if par['ok'] else 'missed'}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--quiet", default="not recorded", help="what else ran meanwhile, for the report")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="fsdp-lora-bench-")
    try:
        hf, tokens, params = model_and_tokens(work, args.model)
        result = {"model": args.model, "params": params, "steps": args.steps, "seq_len": args.seq_len,
                  "command": " ".join(["bench/lora_bench.py"] + sys.argv[1:]), "runs": {}, "quiet": args.quiet,
                  "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()}
        for name in args.runs.split(","):
            result["runs"][name] = train_run(args, name, RUNS[name], hf, tokens, work)
            print(json.dumps(result["runs"][name]), flush=True)
        if not args.no_parity:
            out = os.path.join(work, "parity.json")
            subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lora_parity.py"), "--hf", hf, "--bin", args.bin,
                            "--work", os.path.join(work, "parity"), "--seq-len", "64", "--batch", "1",
                            "--json", out], check=False)
            result["parity"] = json.load(open(out)) if os.path.exists(out) else None
    finally:
        subprocess.run(["rm", "-rf", work], check=False)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"lora-{args.model}")
    json.dump(result, open(base + ".json", "w"), indent=1)
    md = report(result)
    open(base + ".md", "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
