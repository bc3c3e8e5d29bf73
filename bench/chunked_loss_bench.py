#!/usr/bin/env python3
"""The chunked loss (train.loss_chunk_tokens) against whole logits at a published model's size.

Qwen2.5-0.5B by default (151,936-token vocabulary), built by transformers from its published config
with random bf16 weights (bench/scale.py), imported by fsdp-train on 2 ranks through fsdp-run as
bench/lora_bench.py runs it (AdamW, 1 sample per rank per step, OMP_NUM_THREADS=1, nothing offloaded),
in fp32 compute by default (--dtype; on a CPU without AVX-512 a bf16 product takes a slow path, and a
step of the full fine-tune at 512 tokens ran over 3 minutes), at --seq-len tokens, four runs in
fresh processes:

  full / full-chunked             every parameter trained, whole logits / chunks of --chunk tokens
  lora-nf4 / lora-nf4-chunked     LoRA r=16 alpha=32 on the seven projections, NF4 base

Per run: peak RSS per rank (the whole process, and over the steps), the plan's figure, the median
step time of steps 2 to N and the losses. A chunked run whose losses differ from its whole-logits
twin by more than --tol (relative) fails the bench: the work must be the same. Writes
bench/results/chunked_loss-MODEL.md and .json.

Usage: .venv/bin/python bench/chunked_loss_bench.py [--model qwen2.5-0.5b] [--seq-len 512] [--chunk 256]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from lora_bench import LORA, model_and_tokens, train_run  # noqa: E402
from scale import MODELS  # noqa: E402


def commit():
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           stdout=subprocess.PIPE, text=True).stdout.strip()
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def report(r):
    lines = [f"# The chunked loss against whole logits: {r['model']} ({r['params'] / 1e6:.1f}M parameters)", "",
             f"- Commit: {r['commit']}.", "- Machine: this one, 2 cores, 23.5 GiB of RAM, no GPU.",
             "- Threads: `OMP_NUM_THREADS=1`, one intra-op thread per rank. Transport: shared memory.",
             "- Page cache: warm (the model directory and the token file written just before the runs).",
             f"- Quiet: {r['quiet']}.", "", f"Command: `{r['command']}`", "",
             f"Conditions: 2 ranks through fsdp-run, {r['dtype']} compute, fp32 reduction, AdamW, seq_len {r['seq_len']}, "
             f"1 sample per rank per step, {r['steps']} steps, nothing offloaded; chunked runs set "
             f"train.loss_chunk_tokens={r['chunk']}; LoRA r=16 alpha=32 on q,k,v,o,gate,up,down with an NF4 base. "
             "What differs between a pair: only train.loss_chunk_tokens. Peak RSS: VmHWM of each rank's process "
             "(import included) and the largest per-step peak (fsdp-train's metrics). Step time: median of steps "
             "2 to N.", "",
             "| run | peak RSS per rank, process (MiB) | over the steps (MiB) | chunked / whole (steps) | plan per rank "
             "(MiB) | steps / plan | step time (s) | chunked / whole | max relative loss difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        twin = r["runs"].get(name.replace("-chunked", "")) if name.endswith("-chunked") else None
        steps = max(run["peak_rss_steps_mib"])
        ratio = f"{steps / max(twin['peak_rss_steps_mib']):.3f}" if twin else "1"
        t_ratio = f"{run['step_time_s'] / twin['step_time_s']:.2f}" if twin else "1"
        diff = f"{run['loss_rel_diff']:.1e}" if twin else "-"
        plan = run["plan_device_mib"]
        lines.append(
            f"| {name} | {run['peak_rss_process_mib'][0]:,.0f} / {run['peak_rss_process_mib'][1]:,.0f} | "
            f"{run['peak_rss_steps_mib'][0]:,.0f} / {run['peak_rss_steps_mib'][1]:,.0f} | {ratio} | {plan:,.0f} | "
            f"{steps / plan:.2f} | {run['step_time_s']:.2f} | {t_ratio} | {diff} |")
    lines += ["", "Losses (step 1 .. N):", ""]
    for name, run in r["runs"].items():
        lines.append(f"- {name}: " + ", ".join(f"{x:.5f}" for x in run["losses"]))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--tol", type=float, default=2e-3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="fsdp.param_dtype")
    ap.add_argument("--quiet", default="not recorded", help="what else ran on the machine, for the report")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    dtype = ["--set", f"fsdp.param_dtype={args.dtype}"]  # after lora_bench's bfloat16: the last --set wins
    chunk = ["--set", f"train.loss_chunk_tokens={args.chunk}"]
    nf4 = LORA + ["--set", "lora.base_dtype=nf4"]
    runs = {"full": dtype, "full-chunked": dtype + chunk, "lora-nf4": dtype + nf4,
            "lora-nf4-chunked": dtype + nf4 + chunk}
    work = tempfile.mkdtemp(prefix="fsdp-chunked-loss-bench-")
    try:
        hf, tokens, params = model_and_tokens(work, args.model)
        result = {"model": args.model, "params": params, "steps": args.steps, "seq_len": args.seq_len, "dtype": args.dtype,
                  "chunk": args.chunk, "commit": commit(), "quiet": args.quiet,
                  "command": " ".join(["bench/chunked_loss_bench.py"] + sys.argv[1:]), "runs": {}}
        for name, extra in runs.items():
            run = train_run(args, name, extra, hf, tokens, work)
            if name.endswith("-chunked"):
                whole = result["runs"][name.replace("-chunked", "")]["losses"]
                run["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], whole))
            result["runs"][name] = run
            print(json.dumps(run), flush=True)
    finally:
        subprocess.run(["rm", "-rf", work], check=False)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"chunked_loss-{args.model}")
    json.dump(result, open(base + ".json", "w"), indent=1)
    md = report(result)
    open(base + ".md", "w").write(md)
    print(md)
    bad = [n for n, r in result["runs"].items() if r.get("loss_rel_diff", 0) > args.tol]
    if bad:
        raise SystemExit(f"chunked_loss_bench: losses differ beyond {args.tol} in {bad}: not the same work")


if __name__ == "__main__":
    main()
