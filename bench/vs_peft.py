#!/usr/bin/env python3
"""fsdp-train's LoRA fine-tuning against what a user would run instead: transformers + peft in one
process, on this machine and the same work (scripts/bench vs-peft).

A published config with random bf16 weights (bench/write_model.py; --layers truncates it), 1M random
uint32 tokens (or --tokens); each run in fresh processes, the model's files in the page cache:

  fsdp-bf16  fsdp-train, 2 ranks (fsdp-run, OMP_NUM_THREADS=1 each): bf16 base, bf16 compute
  fsdp-fp32  the same, fp32 compute    fsdp-nf4  QLoRA: the projections in NF4 blocks, fp32 compute
  peft-bf16  transformers + peft, one process, 2 threads: the model in bf16
  peft-fp32  the same in fp32: the peer's fastest stock setting here, where bf16 products run at a
             quarter of fp32's speed forward and 100-400x slower for the input's gradient (LibTorch's
             fallback gemm on this AVX2 CPU, on both sides: --run-timeout bounds such runs)
  peft-nf4   QLoRA as peft documents it: bitsandbytes' NF4 (its CPU backend), prepare_model_for_kbit_training

The same work: LoRA r=16 alpha=32 dropout 0 on q,k,v,o,gate,up,down; AdamW over the adapters with
fsdp-train's defaults (apps/fsdp-train/config.h), also set on its command line, its lr per step checked;
clipping to norm 1.0; activation checkpointing on both sides or neither; the samples fsdp-train's file
source cuts (apps/fsdp-train/data.cpp, reproduced here) in its order, 2 x --batch per step; mean fp32
cross-entropy over every token. Step 1's loss (lora_B is zero: the base model's) must agree between
each fsdp run and the peft run of the same precision, else the bench fails (exit 1); later steps
differ by lora_A's random initial values. Writes --out-dir/vs-peft-MODEL[-Nl].md and .json.

Usage: .venv/bin/python bench/vs_peft.py [--model llama-3.2-1b] [--layers N] [--steps 6] [--seq-len 128]
           [--batch 1] [--configs fsdp-bf16,...] [--skip-peft-bf16] [--run-timeout S] [--quiet TEXT] [--keep DIR]
"""
import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from levers_bench import commit  # noqa: E402
from scale import cpu_bf16_text  # noqa: E402
from write_model import CONFIGS  # noqa: E402

MIB = 1 << 20
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fsdp-train's defaults (apps/fsdp-train/config.h), set explicitly on its command line all the same.
OPTIM = {"lr": 6e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 20, "min_lr": 6e-4,
         "grad_clip": 1.0}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
SEED = 0  # train.seed: the data order (and fsdp's adapter init)
RUNS = {  # name: (what, fsdp-train --set values, or peft's base dtype)
    "fsdp-bf16": ("bf16 base, bf16 compute", ["lora.base_dtype=bfloat16", "fsdp.param_dtype=bfloat16"]),
    "fsdp-fp32": ("bf16 base, fp32 compute", ["lora.base_dtype=bfloat16", "fsdp.param_dtype=float32"]),
    "fsdp-nf4": ("NF4 base (QLoRA), fp32 compute", ["lora.base_dtype=nf4", "fsdp.param_dtype=float32"]),
    "fsdp1-bf16": ("one rank x 2 threads: bf16 base, bf16 compute",
                   ["lora.base_dtype=bfloat16", "fsdp.param_dtype=bfloat16"]),
    "fsdp1-nf4": ("one rank x 2 threads: NF4 base (QLoRA), fp32 compute",
                  ["lora.base_dtype=nf4", "fsdp.param_dtype=float32"]),
    "peft-bf16": ("bf16 model, bf16 compute", "bfloat16"),
    "peft-fp32": ("fp32 model, fp32 compute", "float32"),
    "peft-nf4": ("bitsandbytes NF4 (QLoRA), fp32 compute", "nf4"),
}
# Step 1's loss, relative: in bf16 only the rounding of sums in another order could differ (measured:
# equal bits on a 2-layer llama-3.2-1b, 7e-8 on `tiny`: both run the same LibTorch kernels), far
# below 5e-4, which still fails a batch out of order (two batches' losses differ by 1e-3 .. 1e-2 on
# these random models). In fp32 (measured 4e-8) 1e-4 is the project's tolerance.
BF16_TOL, FP32_TOL = 5e-4, 1e-4
PAIRS = [  # fsdp, peft, step-1 loss tolerance (relative; None: not checked), what the pair compares
    ("fsdp-bf16", "peft-bf16", BF16_TOL, "the same precision: bf16 weights and compute"),
    ("fsdp-fp32", "peft-fp32", FP32_TOL, "the same precision: bf16 weight values, fp32 compute"),
    ("fsdp-nf4", "peft-nf4", FP32_TOL, "the same QLoRA: NF4 base (bitsandbytes' codec), fp32 compute"),
    ("fsdp-nf4", "peft-fp32", None, "what a user runs on this CPU: fsdp's QLoRA against peft's fastest"),
    ("fsdp1-bf16", "peft-bf16", BF16_TOL, "one machine's cores in one rank, as peft: bf16"),
    ("fsdp1-nf4", "peft-nf4", FP32_TOL, "one machine's cores in one rank, as peft: QLoRA, fp32 compute"),
]
# fsdp runs on 2 ranks x 1 thread unless named here: one rank x 2 threads, the whole batch at once
# (the machine's two cores in one process, as peft uses them; nothing is sharded or gathered).
ONE_RANK = {"fsdp1-bf16", "fsdp1-nf4"}


def lr_at(step, steps):
    """fsdp::WarmupCosine (src/optim/optim.cpp) with the OPTIM settings: the lr of 0-based `step`."""
    lr, warm, low = OPTIM["lr"], OPTIM["warmup_steps"], OPTIM["min_lr"]
    if step < warm:
        return lr * (step + 1) / warm
    if steps <= warm:
        return lr
    progress = min(1.0, (step - warm) / (steps - warm))
    return low + 0.5 * (lr - low) * (1.0 + math.cos(math.pi * progress))


def mix64(x):
    """splitmix64's finaliser, as train::mix64 (apps/fsdp-train/data.cpp)."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def train_samples(path, seq_len, first, count):
    """Training samples [first, first + count) of a uint32 token file as fsdp-train's file source cuts
    them (apps/fsdp-train/data.cpp): sample k is the window of seq_len + 1 tokens starting at
    mix64(sample_key) mod (train tokens - window + 1), the train split being all but the held-out
    last max(window, count / 10) tokens. int64 [count, seq_len + 1]."""
    import numpy as np
    raw = np.memmap(path, dtype=np.uint32, mode="r")
    tokens = raw[256:raw[258] + 256] if raw[0] == 20240520 else raw  # llm.c's 1024-byte header
    window, n = seq_len + 1, len(tokens)
    held = max(window, n // 10)
    train_len = n - held if n - held >= window else n
    out = np.empty((count, window), dtype=np.int64)
    for i in range(count):
        key = mix64(mix64(mix64(SEED) ^ 0) ^ (first + i))  # split 0: train
        start = mix64(key) % (train_len - window + 1)
        out[i] = tokens[start:start + window]
    return out


def proc_status():
    """This process's VmHWM, VmRSS, RssAnon and RssFile in bytes."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def peft_child(spec, out):
    """(Run as a child, `--peft-child SPEC OUT`: its RSS is its own.) transformers + peft trains the
    adapters for spec's steps; writes per-step loss, lr, grad norm, step time and the peaks."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    s = json.load(open(spec))
    torch.set_num_threads(s["threads"])
    transformers.utils.logging.set_verbosity_error()
    t0 = time.perf_counter()
    kw = {"dtype": torch.bfloat16 if s["dtype"] == "bfloat16" else torch.float32, "attn_implementation": "sdpa"}
    if s["dtype"] == "nf4":
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        kw["device_map"] = "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(s["hf"], **kw)
    model.config.use_cache = False
    ac = {"use_reentrant": False}
    if s["dtype"] == "nf4":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=s["ac"],
                                                gradient_checkpointing_kwargs=ac)
    elif s["ac"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ac)
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr_at(0, s["steps"]), betas=tuple(OPTIM["betas"]), eps=OPTIM["eps"],
                            weight_decay=OPTIM["weight_decay"], fused=True)
    r = {"load_s": time.perf_counter() - t0, "load_peak_rss_bytes": proc_status()["VmHWM"],
         "trainable_params": sum(p.numel() for p in params), "adapter_dtype": str(params[0].dtype),
         "losses": [], "lrs": [], "grad_norms": [], "step_times_s": []}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here on: the steps' peak
    for step in range(s["steps"]):
        w = torch.from_numpy(train_samples(s["tokens"], s["seq_len"], step * s["batch"], s["batch"]))
        inputs, targets = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s["steps"])
        t = time.perf_counter()
        # labels as usual; shift_labels gives every position its next token, the last one included
        loss = model(input_ids=inputs, labels=inputs, shift_labels=targets).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, OPTIM["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        r["step_times_s"].append(time.perf_counter() - t)
        r["losses"].append(loss.item())
        r["lrs"].append(opt.param_groups[0]["lr"])
        r["grad_norms"].append(norm.item())
        now = proc_status()  # written after every step: a run stopped by --run-timeout keeps its steps
        r.update(steps_peak_rss_bytes=now["VmHWM"], end_rss=now,
                 peak_rss_bytes=max(now["VmHWM"], r["load_peak_rss_bytes"]))
        json.dump(r, open(out + ".tmp", "w"))
        os.replace(out + ".tmp", out)
        msg = f"{os.path.basename(out)}: step {step + 1} loss {r['losses'][-1]:.5f} {r['step_times_s'][-1]:.2f} s"
        print(msg, flush=True)


def run_logged(cmd, env, log, timeout):
    """Runs cmd in a session of its own, its output into `log`; after `timeout` seconds (0: none) the
    session is killed (the peft child: one process). (status, output, timed out)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc, timed_out = p.wait(timeout=timeout or None), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc, timed_out = p.wait(), True
    return rc, open(log).read(), timed_out


def fsdp_run(args, name, hf, tokens, work):
    """One fsdp-train run through fsdp-run, on 2 ranks x 1 thread or (ONE_RANK) 1 rank x 2 threads with
    the whole batch; its figures from --metrics and the log."""
    metrics = os.path.join(work, f"{name}.jsonl")
    ranks = 1 if name in ONE_RANK else 2
    sets = ["data.source=file", f"data.path={tokens}", "data.token_dtype=uint32", f"data.seq_len={args.seq_len}",
            f"data.batch_size_per_rank={args.batch * 2 // ranks}", f"lora.r={LORA['r']}", f"lora.alpha={LORA['alpha']}",
            f"lora.dropout={LORA['dropout']}", f"lora.targets={','.join(TARGETS)}", "fsdp.reduce_dtype=float32",
            f"train.activation_checkpointing={args.activation_checkpointing}", f"train.seed={SEED}",
            "train.eval_every=0", "train.log_every=1", "fsdp.timeout_s=600", "optim.schedule=cosine",
            *(f"optim.{k}={json.dumps(v)}" for k, v in OPTIM.items()), *RUNS[name][1]]
    # fsdp-run's own --timeout-s stops the ranks too (each has a process group of its own); exit 124.
    cmd = [os.path.join(args.bin, "fsdp-run"), "--nproc-per-node", str(ranks), "--timeout-s", str(args.run_timeout), "--",
           os.path.join(args.bin, "fsdp-train"), "--init-from", hf, "--steps", str(args.steps), "--metrics", metrics]
    for s in sets:
        cmd += ["--set", s]
    print(f"vs_peft: {name}", flush=True)
    t0 = time.perf_counter()
    if os.path.exists(metrics):
        os.remove(metrics)  # fsdp-train appends
    rc, out, _ = run_logged(cmd, dict(os.environ, OMP_NUM_THREADS=str(2 // ranks)), os.path.join(work, f"{name}.log"), 0)
    timed_out = args.run_timeout > 0 and rc == 124
    steps = [json.loads(line) for line in open(metrics) if '"eval' not in line] if os.path.exists(metrics) else []
    if timed_out and not steps:
        return {"failed": f"no step finished in --run-timeout {args.run_timeout} s", "unmeasured": True}
    if rc != 0 and not timed_out:
        return {"failed": f"fsdp-train: status {rc}: {out[-2000:]}"}
    r = {"wall_s": time.perf_counter() - t0, "losses": [s["loss"] for s in steps], "lrs": [s["lr"] for s in steps],
         "grad_norms": [s.get("grad_norm") for s in steps], "step_times_s": [s["step_time_s"] for s in steps],
         "steps_peak_rss_mib": [max(s["peak_rss_bytes"][r] for s in steps) / MIB for r in range(ranks)]}
    whole = re.search(r"peak RSS per rank: ([\d. ]+MiB(?: [\d.]+ MiB)*)", out.split("done:")[-1])
    # Stopped by --run-timeout: no whole-process figure; the steps' peaks (metrics) stand for it.
    r["peak_rss_mib"] = [float(x) for x in re.findall(r"([\d.]+) MiB", whole.group(1))] if whole and not timed_out \
        else r["steps_peak_rss_mib"]
    r["machine_peak_mib"] = sum(r["peak_rss_mib"])
    return r


def peft_run(args, name, hf, tokens, work, params):
    """One peft run in a child process (2 threads); skipped when its weights alone exceed the memory
    available, failed (not fatal) when it is killed."""
    dtype = RUNS[name][1]
    need = params * {"bfloat16": 2, "float32": 4, "nf4": 0.6}[dtype]
    avail = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemAvailable"))
    if need > avail:
        return {"failed": f"not run: its weights alone take {need / 2**30:.1f} GiB, "
                          f"{avail / 2**30:.1f} GiB available", "unmeasured": True}
    spec, out = os.path.join(work, f"{name}.spec.json"), os.path.join(work, f"{name}.json")
    json.dump({"hf": hf, "tokens": tokens, "dtype": dtype, "steps": args.steps, "seq_len": args.seq_len,
               "batch": 2 * args.batch, "ac": args.activation_checkpointing == "every", "threads": 2}, open(spec, "w"))
    if os.path.exists(out):
        os.remove(out)
    print(f"vs_peft: {name}", flush=True)
    t0 = time.perf_counter()
    rc, text, timed_out = run_logged([sys.executable, os.path.abspath(__file__), "--peft-child", spec, out],
                                     dict(os.environ, OMP_NUM_THREADS="2"), os.path.join(work, f"{name}.log"),
                                     args.run_timeout)
    if not timed_out and (rc < 0 or rc == 137):  # killed from outside (the kernel's OOM killer)
        return {"failed": f"killed by signal {-rc if rc < 0 else 9}: it did not fit", "unmeasured": True}
    if timed_out and not os.path.exists(out):
        return {"failed": f"no step finished in --run-timeout {args.run_timeout} s", "unmeasured": True}
    if rc != 0 and not timed_out:
        return {"failed": f"status {rc}: {text[-2000:]}"}
    r = json.load(open(out))
    r.update(wall_s=time.perf_counter() - t0, peak_rss_mib=[r["peak_rss_bytes"] / MIB],
             machine_peak_mib=r["peak_rss_bytes"] / MIB, steps_peak_rss_mib=[r["steps_peak_rss_bytes"] / MIB])
    return r


def summarize(run, args):
    """Median step time after the first step, and tokens/s, added to a finished run."""
    if "failed" in run:
        return
    if len(run["losses"]) < args.steps:
        run["stopped"] = f"stopped by --run-timeout {args.run_timeout} s after {len(run['losses'])} of " \
            f"{args.steps} steps" + ("; its step time is step 1's" if len(run["losses"]) == 1 else "")
    later = run["step_times_s"][1:] or run["step_times_s"]
    run["step_time_s"] = statistics.median(later)
    run["tokens_per_s"] = 2 * args.batch * args.seq_len / run["step_time_s"]


def compare(result):
    """The pairs' ratios and step-1 loss checks, and fsdp's lr against the schedule; the failures."""
    runs, failures, pairs = result["runs"], [], []
    for name, run in runs.items():
        if name.startswith("fsdp") and "failed" not in run:
            want = [lr_at(k, result["steps"]) for k in range(len(run["lrs"]))]
            if any(abs(a - b) > 1e-12 * b for a, b in zip(run["lrs"], want)):
                failures.append(f"{name}: fsdp-train's lr per step {run['lrs']} is not the schedule's {want}")
    for a, b, tol, what in PAIRS:
        if a not in runs or b not in runs or "failed" in runs[a] or "failed" in runs[b]:
            continue
        fa, pb = runs[a], runs[b]
        rel = [abs(x - y) / abs(y) for x, y in zip(fa["losses"], pb["losses"])]
        pair = {"fsdp": a, "peft": b, "what": what, "tol": tol, "step1_rel_diff": rel[0], "max_rel_diff": max(rel),
                "step_ratio": fa["step_time_s"] / pb["step_time_s"],
                "memory_ratio": fa["machine_peak_mib"] / pb["machine_peak_mib"]}
        pair["step_goal"] = pair["step_ratio"] <= 1
        pair["memory_goal"] = pair["memory_ratio"] < 1
        pairs.append(pair)
        if tol is not None and not rel[0] <= tol:
            failures.append(f"{a} vs {b}: step 1's loss {fa['losses'][0]:.6f} vs {pb['losses'][0]:.6f}, relative "
                            f"difference {rel[0]:.2e} over the tolerance {tol:g}: not the same work (data, model)")
    failures += [f"{n}: {run['failed']}" for n, run in runs.items() if "failed" in run and not run.get("unmeasured")]
    result["pairs"], result["failures"] = pairs, failures
    return failures


def conditions(r):
    """The report's lines on the conditions of every figure and on what differs between the systems."""
    v = r["versions"]
    return [
        f"- Commit: {r['commit']}. Machine: this one, {r['cores']} cores, {r['mem_gib']:.1f} GiB of RAM, no GPU; "
        f"{r.get('cpu_bf16', 'the CPU not recorded')}. "
        f"Page cache: warm (the model's files written or read just before). Quiet: {r['quiet']}.",
        f"- Command: `{r['command']}`",
        f"- Versions: torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, bitsandbytes "
        f"{v['bitsandbytes']}.",
        f"- The same work: LoRA r={LORA['r']} alpha={LORA['alpha']} dropout {LORA['dropout']:g} on "
        f"{','.join(TARGETS)}; AdamW over the adapters, lr {OPTIM['lr']:g} (warmup {OPTIM['warmup_steps']} steps, "
        f"cosine to {OPTIM['min_lr']:g}; fsdp-train's lr per step checked against it), betas {OPTIM['betas']}, "
        f"eps {OPTIM['eps']:g}, weight decay {OPTIM['weight_decay']:g}; gradient norm clipped to "
        f"{OPTIM['grad_clip']:g}; activation checkpointing: {r['activation_checkpointing']}; {r['steps']} steps of "
        f"{2 * r['batch']} samples x {r['seq_len']} tokens, fsdp-train's samples in its order; mean fp32 "
        "cross-entropy over every token.",
        "- Threads: fsdp 2 ranks x 1 thread (fsdp-run, OMP_NUM_THREADS=1, shared-memory transport, FULL_SHARD, "
        f"{r['batch']} sample(s) per rank), the fsdp1-* runs 1 rank x 2 threads (OMP_NUM_THREADS=2, "
        f"{2 * r['batch']} samples at once); peft 1 process x 2 threads (torch.set_num_threads(2)), the whole batch "
        "at once; peft's AdamW fused=True, use_cache=False, sdpa attention (fsdp-train's default too).",
        "- What differs: fsdp keeps each adapter's fp32 master and computes it in the compute dtype; peft keeps the "
        "adapters in fp32 and computes them in fp32 on its bf16 base too (autocast_adapter_dtype). lora_A's initial "
        "values (the same distribution, other draws). peft-nf4 also runs peft's prepare_model_for_kbit_training (the "
        "rest of the base in fp32, as fsdp-nf4 keeps it). fsdp's step time includes cutting its batch and the "
        "metrics' all-gather; peft's is forward, backward, clipping, step and zero_grad.",
        "- Peak RSS: VmHWM of each process over its whole life, load included (an fsdp run stopped by "
        "--run-timeout: its steps' peaks only); fsdp's per machine is the sum of its ranks' peaks, which need not "
        "coincide and each count LibTorch's pages: an upper bound (fsdp-run's own few MiB left out)."]


def report(r):
    """The markdown report."""
    layers = f", truncated to {r['layers']} layers" if r["layers"] else ""
    mark = {True: "met", False: "missed"}
    lines = [f"# fsdp-train against transformers + peft: LoRA on {r['model']}{layers} "
             f"({r['params'] / 1e6:.1f}M parameters)", "", *conditions(r), "",
             "| run | what | step time (s, median of steps 2..N) | tokens/s | peak RSS per process (MiB) | "
             "per machine (MiB) | over the steps (MiB) | wall (s) | losses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        if "failed" in run:
            lines.append(f"| {name} | {RUNS[name][0]} | {run['failed'].splitlines()[0][:200]} | | | | | | |")
            continue
        stopped = f" ({run['stopped']})" if "stopped" in run else ""
        lines.append(f"| {name}{stopped} | {RUNS[name][0]} | {run['step_time_s']:.2f} | {run['tokens_per_s']:.1f} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['peak_rss_mib'])} | {run['machine_peak_mib']:,.0f} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['steps_peak_rss_mib'])} | {run['wall_s']:.0f} | "
                     f"{', '.join(f'{x:.5f}' for x in run['losses'])} |")
    lines += ["", "| fsdp | peft | compares | step 1 loss, relative difference | largest over the steps | "
              "step time fsdp / peft (goal <= 1) | peak per machine fsdp / peft (goal < 1) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in r["pairs"]:
        d = p["step1_rel_diff"]
        check = f"{d:.1e} (not checked: other base values)" if p["tol"] is None else \
            f"{d:.1e} (<= {p['tol']:g}: {'ok' if d <= p['tol'] else 'FAILED'})"
        lines.append(f"| {p['fsdp']} | {p['peft']} | {p['what']} | {check} | {p['max_rel_diff']:.1e} | "
                     f"{p['step_ratio']:.2f} ({mark[p['step_goal']]}) | {p['memory_ratio']:.2f} "
                     f"({mark[p['memory_goal']]}) |")
    lines += ["", "Goals (the issue's): fsdp's step no slower than peft's; fsdp's peak memory per machine below "
              "peft's.", ""]
    for p in r["pairs"]:
        lines.append(f"- {p['fsdp']} against {p['peft']}: step time goal {mark[p['step_goal']]} "
                     f"({p['step_ratio']:.2f}x peft's), memory goal {mark[p['memory_goal']]} "
                     f"({p['memory_ratio']:.2f}x peft's peak per machine).")
    lines += [f"- FAILED: {f}" for f in r["failures"]]
    return "\n".join(lines) + "\n"


def model_and_tokens(args, work):
    """The model's directory under `work` (bench/write_model.py; one written there for the same model and
    --layers is reused) and the token file (--tokens, or 1M random uint32 tokens): (hf, tokens, params)."""
    import numpy as np
    hf, stamp, tag = os.path.join(work, "hf"), os.path.join(work, "hf.model"), f"{args.model} layers={args.layers}"
    if not (os.path.exists(stamp) and open(stamp).read() == tag):
        subprocess.run(["rm", "-rf", hf], check=True)
        cmd = [sys.executable, os.path.join(ROOT, "bench", "write_model.py"), "--model", args.model, hf]
        subprocess.run(cmd + (["--layers", str(args.layers)] if args.layers else []), check=True,
                       stdout=subprocess.DEVNULL)
        open(stamp, "w").write(tag)
    params = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["metadata"]["total_size"] // 2
    if args.tokens:
        return hf, os.path.abspath(args.tokens), params
    tokens = os.path.join(work, "train.bin")
    vocab = json.load(open(os.path.join(hf, "config.json")))["vocab_size"]
    np.random.default_rng(0).integers(0, vocab, size=1 << 20, dtype=np.uint32).tofile(tokens)
    return hf, tokens, params


def versions():
    """The installed versions of the Python side's packages."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=0, help="truncate the model to this many decoder layers")
    ap.add_argument("--tokens", help="a uint32 token file (default: 1M random tokens)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    ap.add_argument("--batch", type=int, default=1, help="samples per rank per step; peft's: twice that (default 1)")
    ap.add_argument("--activation-checkpointing", choices=["none", "every"], default="none")
    ap.add_argument("--configs", default=",".join(RUNS), help="comma-separated runs of " + ", ".join(RUNS))
    ap.add_argument("--skip-peft-bf16", action="store_true", help="leave out peft-bf16 (slow on this CPU)")
    ap.add_argument("--run-timeout", type=int, default=0, metavar="S",
                    help="stop a run after S seconds and report the steps it finished (0: no limit)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (a model written there is reused)")
    ap.add_argument("--quiet", default="not recorded", help="what else ran on the machine, for the report")
    ap.add_argument("--peft-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peft_child:
        return peft_child(*args.peft_child)
    names = [n for n in args.configs.split(",") if not (args.skip_peft_bf16 and n == "peft-bf16")]
    if any(n not in RUNS for n in names):
        ap.error(f"--configs: {args.configs}: each of {', '.join(RUNS)}")
    args.bin = os.path.abspath(args.bin)
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="fsdp-vs-peft-")
    os.makedirs(work, exist_ok=True)
    try:
        hf, tokens, params = model_and_tokens(args, work)
        mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")) / 2**20
        result = {"model": args.model, "layers": args.layers, "params": params, "steps": args.steps,
                  "seq_len": args.seq_len, "batch": args.batch,
                  "activation_checkpointing": args.activation_checkpointing,
                  "commit": commit(), "quiet": args.quiet, "cores": os.cpu_count(), "mem_gib": mem, "cpu_bf16": cpu_bf16_text(),
                  "command": shlex.join(["bench/vs_peft.py"] + sys.argv[1:]), "optim": OPTIM, "lora": LORA,
                  "versions": versions(), "runs": {}}
        for name in names:
            run = fsdp_run(args, name, hf, tokens, work) if name.startswith("fsdp") else \
                peft_run(args, name, hf, tokens, work, params)
            summarize(run, args)
            result["runs"][name] = run
            print(f"vs_peft: {name}: " + (run["failed"][:300] if "failed" in run else
                  f"step {run['step_time_s']:.2f} s, peak per machine {run['machine_peak_mib']:,.0f} MiB, "
                  f"losses {', '.join(f'{x:.5f}' for x in run['losses'])}"), flush=True)
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", work], check=False)
    failures = compare(result)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"vs-peft-{args.model}" + (f"-{args.layers}l" if args.layers else ""))
    json.dump(result, open(base + ".json", "w"), indent=1)
    md = report(result)
    open(base + ".md", "w").write(md)
    print(md)
    if failures:
        sys.exit("vs_peft: FAILED:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
