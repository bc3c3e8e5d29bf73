#!/usr/bin/env python3
"""The levers of issue-tracked memory and communication work, each against the run without it, on
this machine; writes bench/results/levers-LEVER.json and rewrites bench/results/levers.md from every
levers-*.json there.

  bf16-state   AdamW's moments in bf16 (optim.state_dtype) against fp32 moments:
               (a) peak RSS and step time of a full fine-tune of --model (Qwen2.5-0.5B: random bf16
                   weights from its published config, bench/scale.py), 2 ranks through fsdp-run,
                   fp32 compute (bf16 products take a slow path on a CPU without AVX-512), seq
                   --seq-len, 1 sample per rank per step, --steps steps, nothing offloaded; the
                   plan's figure for each, so the planned effect stands beside the measured one;
                   the losses must agree within --tol (relative) or the bench fails;
               (b) the loss curve over --curve-steps steps of a small Llama on real text (the
                   Python standard library's source, a BPE trained here as scripts/finetune-demo
                   does), the same data and seed both ways: the gap between the curves.
  keep-gathered  every unit kept gathered across the 4 micro-batches of a step (train.keep_gathered)
               against gathering per micro-batch: QLoRA (NF4 base) of --model, 2 ranks, fp32 compute:
               all-gather bytes per step against the plan, peak RSS against the plan, step time; the
               losses must be the same bits.
  hsdp-accum   HYBRID_SHARD on 4 ranks as 2 replicas of 2 (two simulated nodes on this one), 4
               micro-batches per step, each train.accumulation: bytes per step by collective
               (the replicas' all-reduce, the reduce-scatters), the partial sums' bytes against the
               plan, step time, peak RSS; the losses must agree within 1e-5.

  replicated-adapters  the adapters whole on every rank and all-reduced (lora.replicate_adapters)
               against sharded adapters: QLoRA (NF4 base) of --model, 2 ranks, fp32 compute: step
               time, peak RSS, all-gather and reduction bytes, each against the plan; the losses must
               agree within 1e-5 (the reductions sum in another order).
  reshard-group  fsdp.reshard_after_forward_group=2 on 4 ranks as 2 simulated nodes of 2, against
               resharding to nothing (0) and keeping everything (1): all-gather bytes across the whole
               group and inside the node groups, peak RSS, each against the plan, step time; the
               losses must be the same bits.

Usage: .venv/bin/python bench/levers_bench.py bf16-state [--model qwen2.5-0.5b] [--seq-len 128]
       .venv/bin/python bench/levers_bench.py hsdp-accum
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
MIB = 1 << 20


def commit():
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           stdout=subprocess.PIPE, text=True).stdout.strip()
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def drop_caches():
    """Empties the page cache (needs root or sudo), so that the part of each process's RSS that maps
    LibTorch's pages starts from the same state in every run."""
    subprocess.run(["sync"], check=True)
    cmd = ["tee", "/proc/sys/vm/drop_caches"] if os.geteuid() == 0 else ["sudo", "-n", "tee", "/proc/sys/vm/drop_caches"]
    p = subprocess.run(cmd, input="3\n", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"levers_bench: --drop-caches needs root or password-less sudo: {p.stderr.strip()}")


def fsdp_train(args, work, name, nproc, train_args):
    """One fsdp-train run through fsdp-run; its figures."""
    metrics = os.path.join(work, f"{name}.jsonl")
    cmd = [os.path.join(args.bin, "fsdp-run"), "--nproc-per-node", str(nproc), "--timeout-s", "3600", "--",
           os.path.join(args.bin, "fsdp-train"), *train_args, "--set", "train.eval_every=0",
           "--set", "train.log_every=1", "--set", "fsdp.timeout_s=600", "--metrics", metrics]
    print(f"levers_bench: {name}", flush=True)
    if args.drop_caches:
        drop_caches()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        raise SystemExit(f"levers_bench: {name} failed (status {p.returncode}):\n{p.stdout[-3000:]}")
    steps = [json.loads(line) for line in open(metrics) if '"eval' not in line]
    whole = re.search(r"peak RSS per rank: ([\d. ]+MiB(?: [\d.]+ MiB)*)", p.stdout.split("done:")[-1])
    plan = re.search(r"memory (?:\(RAM\) )?per rank: ([\d.]+) MiB", p.stdout)
    sharded = re.search(r"params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+) MiB", p.stdout)
    levers = re.search(r"plan vs measured \(rank 0\): (.*)", p.stdout)
    later = steps[1:] if len(steps) > 1 else steps
    return {
        "name": name,
        "peak_rss_process_mib": [float(x) for x in re.findall(r"([\d.]+) MiB", whole.group(1))] if whole else None,
        "peak_rss_steps_mib": [max(s["peak_rss_bytes"][r] for s in steps) / MIB for r in range(nproc)],
        "step_time_s": statistics.median(s["step_time_s"] for s in later),
        "plan_device_mib": float(plan.group(1)) if plan else None,
        "sharded_mib": [float(x) for x in sharded.groups()] if sharded else None,
        "levers": levers.group(1).strip() if levers else None,
        "losses": [s["loss"] for s in steps],
        "all_reduce_bytes": [s.get("all_reduce_bytes", [0])[0] for s in steps],
        "reduce_scatter_bytes": [s["reduce_scatter_bytes"][0] for s in steps],
        "allgather_bytes": [s["allgather_bytes"][0] for s in steps],
    }


def rel_gap(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ---- bf16-state

def stdlib_tokens(work, vocab):
    """Token files of the Python standard library's source (train, eval) with a BPE trained here."""
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("finetune_demo", os.path.join(ROOT, "scripts", "finetune-demo"))
    spec = importlib.util.spec_from_loader("finetune_demo", loader)
    demo = importlib.util.module_from_spec(spec)
    loader.exec_module(demo)
    train_files = demo.python_sources(demo.TRAIN_PACKAGES)
    tok = demo.make_tokenizer(work, train_files, vocab)
    out = os.path.join(work, "text.bin")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tokenize"), "--tokenizer", tok, "--out", out,
                    "--dtype", "uint16", *train_files], check=True, stdout=subprocess.DEVNULL)
    return out


def bf16_state(args, work):
    from lora_bench import model_and_tokens
    result = {"lever": "bf16-state", "commit": commit(), "quiet": args.quiet,
              "command": " ".join(["bench/levers_bench.py"] + sys.argv[1:]), "model": args.model,
              "seq_len": args.seq_len, "steps": args.steps, "curve_steps": args.curve_steps, "runs": {}}
    hf, tokens, params = model_and_tokens(work, args.model)
    result["params"] = params
    base = ["--init-from", hf, "--steps", str(args.steps), "--set", "data.source=file", "--set", f"data.path={tokens}",
            "--set", "data.token_dtype=uint32", "--set", f"data.seq_len={args.seq_len}",
            "--set", "data.batch_size_per_rank=1", "--set", "fsdp.param_dtype=float32",
            "--set", "fsdp.reduce_dtype=float32"]
    for name, dtype in (("fp32-state", "float32"), ("bf16-state", "bfloat16")):
        result["runs"][name] = fsdp_train(args, work, name, 2, base + ["--set", f"optim.state_dtype={dtype}"])
        print(json.dumps(result["runs"][name]), flush=True)
    a, b = result["runs"]["fp32-state"], result["runs"]["bf16-state"]
    result["loss_rel_gap"] = rel_gap(b["losses"], a["losses"])
    # The loss curve on real text: a small Llama, the same data and seed both ways.
    text = stdlib_tokens(work, 4096)
    small = ["--steps", str(args.curve_steps), "--set", "data.source=file", "--set", f"data.path={text}",
             "--set", "data.token_dtype=uint16", "--set", "model.vocab_size=4096", "--set", "model.hidden_size=256",
             "--set", "model.intermediate_size=768", "--set", "model.num_hidden_layers=4",
             "--set", "model.num_attention_heads=4", "--set", "model.num_key_value_heads=4",
             "--set", "data.seq_len=128", "--set", "data.batch_size_per_rank=8", "--set", "optim.lr=1e-3",
             "--set", "optim.min_lr=1e-4", "--set", "optim.warmup_steps=20"]
    curves = {}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        run = fsdp_train(args, work, f"curve-{name}", 2, small + ["--set", f"optim.state_dtype={dtype}"])
        curves[name] = run["losses"]
    result["curve"] = curves
    return result


def bf16_state_md(r):
    a, b = r["runs"]["fp32-state"], r["runs"]["bf16-state"]
    planned = a["plan_device_mib"] - b["plan_device_mib"]
    measured = max(a["peak_rss_process_mib"]) - max(b["peak_rss_process_mib"])
    measured_steps = max(a["peak_rss_steps_mib"]) - max(b["peak_rss_steps_mib"])
    lines = ["## AdamW's moments in bf16 (`optim.state_dtype`, `AdamWOptions::state_dtype`)", "",
             f"- Commit: {r['commit']}. Machine: this one, 2 cores, 23.5 GiB of RAM, no GPU. "
             "Threads: `OMP_NUM_THREADS=1` per rank. Transport: shared memory. Page cache: warm (the model "
             f"and token files written just before). Quiet: {r['quiet']}.",
             f"- Command: `{r['command']}`", "",
             f"### Memory and step time: full fine-tune of {r['model']} ({r['params'] / 1e6:.1f}M parameters)", "",
             f"2 ranks, fp32 compute and reduction, AdamW, seq_len {r['seq_len']}, 1 sample per rank per step, "
             f"{r['steps']} steps, nothing offloaded. What differs: only `optim.state_dtype`. Peak RSS: VmHWM of "
             "each rank's process (import included) and the largest per-step peak (fsdp-train's metrics). Step "
             "time: median of steps 2 to N.", "",
             "| moments | peak RSS per rank, process (MiB) | over the steps (MiB) | plan per rank (MiB) | "
             "sharded optimizer state, rank 0 (MiB) | step time (s) | losses |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        lines.append(f"| {name} | {' / '.join(f'{x:,.0f}' for x in run['peak_rss_process_mib'])} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['peak_rss_steps_mib'])} | {run['plan_device_mib']:,.0f} | "
                     f"{run['sharded_mib'][2]:,.1f} | {run['step_time_s']:.2f} | "
                     f"{', '.join(f'{x:.5f}' for x in run['losses'])} |")
    lines += ["",
              f"- Effect on the peak: planned {planned:,.0f} MiB less per rank; measured {measured:,.0f} MiB "
              f"(process) and {measured_steps:,.0f} MiB (steps): {measured / planned:.2f}x and "
              f"{measured_steps / planned:.2f}x the plan's figure." if planned > 0 else "- planned effect: none",
              f"- Step time: {b['step_time_s'] / a['step_time_s']:.2f}x the fp32 moments' (the widening and the "
              "stochastic rounding of each chunk of the moments).",
              f"- Losses: largest relative difference over the {r['steps']} steps {r['loss_rel_gap']:.1e}.", ""]
    fp, bf = r["curve"]["fp32"], r["curve"]["bf16"]
    n = len(fp)
    tail = max(1, n // 6)
    gap = [abs(x - y) for x, y in zip(bf, fp)]
    mean_tail = sum(bf[-tail:]) / tail - sum(fp[-tail:]) / tail
    lines += [f"### The loss curve over {n} steps on real text", "",
              "A Llama of hidden size 256, 4 layers and a vocabulary of 4096 (a BPE trained here on the "
              "Python standard library's source, which is also the training text), 2 ranks, seq_len 128, 8 "
              "samples per rank per step, lr 1e-3 with 20 warmup steps and cosine decay to 1e-4, fp32 compute; "
              "the same data order and initial weights both ways.", "",
              "| step | " + " | ".join(str(s) for s in range(0, n, max(1, n // 10))) + f" | {n} |",
              "| --- | " + " | ".join("---" for _ in range(0, n, max(1, n // 10))) + " | --- |",
              "| fp32 moments | " + " | ".join(f"{fp[s]:.4f}" for s in range(0, n, max(1, n // 10))) + f" | {fp[-1]:.4f} |",
              "| bf16 moments | " + " | ".join(f"{bf[s]:.4f}" for s in range(0, n, max(1, n // 10))) + f" | {bf[-1]:.4f} |",
              "",
              f"- Largest absolute gap at any step: {max(gap):.4f} (step {gap.index(max(gap)) + 1}); mean over the "
              f"last {tail} steps: bf16 minus fp32 = {mean_tail:+.4f} (fp32's mean there: "
              f"{sum(fp[-tail:]) / tail:.4f}).", ""]
    return lines


# ---- keep-gathered

def set_args(argv):
    """The --set pairs of fsdp-train arguments: what fsdp-plan takes for the same run."""
    return [x for i in range(len(argv) - 1) if argv[i] == "--set" for x in argv[i:i + 2]]


def qlora_args(args, hf, tokens, extra):
    """fsdp-train's arguments for QLoRA (NF4 base) of the HF directory on the token file: fp32 compute
    and reduction, 1 sample per rank per micro-batch, and `extra`."""
    lora = ["--set", f"lora.r={args.lora_r}", "--set", f"lora.alpha={2 * args.lora_r}"]
    return ["--init-from", hf, "--steps", str(args.steps), "--set", "data.source=file", "--set", f"data.path={tokens}",
            "--set", "data.token_dtype=uint32", "--set", f"data.seq_len={args.seq_len}",
            "--set", "data.batch_size_per_rank=1", *extra, "--set", "fsdp.param_dtype=float32",
            "--set", "fsdp.reduce_dtype=float32", *lora, "--set", "lora.base_dtype=nf4"]


def keep_gathered(args, work):
    from lora_bench import model_and_tokens
    result = {"lever": "keep-gathered", "commit": commit(), "quiet": args.quiet,
              "command": " ".join(["bench/levers_bench.py"] + sys.argv[1:]), "model": args.model,
              "seq_len": args.seq_len, "steps": args.steps, "lora_r": args.lora_r, "runs": {}}
    hf, tokens, params = model_and_tokens(work, args.model)
    result["params"] = params
    base = qlora_args(args, hf, tokens, ["--set", "train.grad_accum_steps=4"])
    for name, keep in (("regathered", "false"), ("kept", "true")):
        run = fsdp_train(args, work, name, 2, base + ["--set", f"train.keep_gathered={keep}"])
        sets = set_args(base)
        plan = subprocess.run([os.path.join(args.bin, "fsdp-plan"), "--nproc-per-node", "2", "--hf-config", hf,
                               *sets, "--set", f"train.keep_gathered={keep}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        m = re.search(r"all-gathers send ([\d.]+) MiB", plan.stdout)
        run["plan_allgather_mib"] = float(m.group(1)) if m else None
        t = re.search(r"memory (?:\(RAM\) )?per rank: ([\d.]+) MiB", plan.stdout)
        run["plan_total_mib"] = float(t.group(1)) if t else None
        result["runs"][name] = run
        print(json.dumps(run), flush=True)
    a, b = result["runs"]["regathered"], result["runs"]["kept"]
    result["loss_rel_gap"] = rel_gap(b["losses"], a["losses"])
    return result


def keep_gathered_md(r):
    a, b = r["runs"]["regathered"], r["runs"]["kept"]
    lines = ["## Units gathered once per step (`train.keep_gathered`, `FSDPModule::set_reshard_after_forward` / "
             "`_backward`)", "",
             f"- Commit: {r['commit']}. Machine: this one, 2 cores, no GPU. Threads: `OMP_NUM_THREADS=1` per rank. "
             f"Transport: shared memory. Page cache: warm. Quiet: {r['quiet']}.", f"- Command: `{r['command']}`", "",
             f"QLoRA of {r['model']} ({r['params'] / 1e6:.1f}M parameters: NF4 base, r={r.get('lora_r', 16)} alpha="
             f"{2 * r.get('lora_r', 16)} on the seven projections), 2 ranks, fp32 compute and reduction, AdamW, seq_len {r['seq_len']}, 4 micro-batches of "
             f"1 sample per rank per step, {r['steps']} steps. What differs: only `train.keep_gathered`. All-gather "
             "bytes: what rank 0 sent per step (the last step); the plan's from fsdp-plan with the same settings.",
             "",
             "| units | all-gather sent (MiB/step) | planned (MiB/step) | peak RSS per rank, process (MiB) | over the "
             "steps (MiB) | plan per rank (MiB) | step time (s) | losses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        lines.append(f"| {name} | {run['allgather_bytes'][-1] / MIB:.2f} | {run['plan_allgather_mib']} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['peak_rss_process_mib'])} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['peak_rss_steps_mib'])} | {run['plan_device_mib']:,.0f} | "
                     f"{run['step_time_s']:.2f} | {', '.join(f'{x:.5f}' for x in run['losses'])} |")
    extra_plan = b["plan_device_mib"] - a["plan_device_mib"]
    extra = max(b["peak_rss_steps_mib"]) - max(a["peak_rss_steps_mib"])
    lines += ["",
              f"- All-gathers: {b['allgather_bytes'][-1] / a['allgather_bytes'][-1]:.3f}x the bytes per step; step time "
              f"{b['step_time_s'] / a['step_time_s']:.2f}x.",
              f"- Memory: the steps' peak {extra:+,.0f} MiB per rank against {extra_plan:+,.0f} MiB planned "
              f"({extra / extra_plan:.2f}x)." if extra_plan else "- Memory: no planned difference.",
              f"- Losses: largest relative difference {r['loss_rel_gap']:.1e} (the same bits are expected).", ""]
    return lines


# ---- replicated-adapters

def plan_figures(args, nproc, argv):
    """fsdp-plan's per-step bytes and memory total for a run's settings."""
    plan = subprocess.run([os.path.join(args.bin, "fsdp-plan"), "--nproc-per-node", str(nproc), *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    num = lambda pattern: (lambda m: float(m.group(1)) if m else None)(re.search(pattern, plan.stdout))
    return {"plan_allgather_mib": num(r"all-gathers send ([\d.]+) MiB"),
            "plan_group_allgather_mib": num(r"([\d.]+) MiB of it inside post-forward groups") or 0.0,
            "plan_reduce_mib": num(r"reductions send ([\d.]+) MiB"),
            "plan_total_mib": num(r"memory (?:\(RAM\) )?per rank: ([\d.]+) MiB")}


def replicated_adapters(args, work):
    """Sharded against replicated adapters at each rank of --ranks: the step time and bytes at the
    usual rank, the memory effect where it stands well above the allocator's noise."""
    from lora_bench import model_and_tokens
    ranks = [int(x) for x in args.ranks.split(",")]
    result = {"lever": "replicated-adapters", "commit": commit(), "quiet": args.quiet,
              "command": " ".join(["bench/levers_bench.py"] + sys.argv[1:]), "model": args.model,
              "seq_len": args.seq_len, "steps": args.steps, "lora_ranks": ranks, "runs": {},
              "page_cache": "emptied before each run" if args.drop_caches else "warm"}
    hf, tokens, params = model_and_tokens(work, args.model)
    result["params"] = params
    for r in ranks:
        args.lora_r = r
        base = qlora_args(args, hf, tokens, [])
        sets = set_args(base)
        for mode, on in (("sharded", "false"), ("replicated", "true")):
            name = f"{mode} r={r}"
            run = fsdp_train(args, work, name.replace(" ", "-"), 2, base + ["--set", f"lora.replicate_adapters={on}"])
            run.update(plan_figures(args, 2, ["--hf-config", hf, *sets, "--set", f"lora.replicate_adapters={on}"]))
            run.update({"mode": mode, "lora_r": r})
            result["runs"][name] = run
            print(json.dumps(run), flush=True)
        a, b = result["runs"][f"sharded r={r}"], result["runs"][f"replicated r={r}"]
        result.setdefault("loss_rel_gaps", {})[str(r)] = rel_gap(b["losses"], a["losses"])
    result["loss_rel_gap"] = max(result["loss_rel_gaps"].values())
    return result


def bytes_row(run):
    sent = lambda key: run[key][-1] / MIB if run.get(key) else 0.0
    return sent("allgather_bytes"), sent("reduce_scatter_bytes") + sent("all_reduce_bytes")


def replicated_md(r):
    ranks = r.get("lora_ranks", [r.get("lora_r", 16)])
    lines = ["## Adapters replicated instead of sharded (`lora.replicate_adapters`, "
             "`FullyShardOptions::replicate_params`)", "",
             f"- Commit: {r['commit']}. Machine: this one, 2 cores, no GPU. Threads: `OMP_NUM_THREADS=1` per rank. "
             f"Transport: shared memory. Page cache: {r.get('page_cache', 'warm')}. Quiet: {r['quiet']}.",
             f"- Command: `{r['command']}`", "",
             f"QLoRA of {r['model']} ({r['params'] / 1e6:.1f}M parameters: NF4 base, adapters of rank r and alpha 2r "
             f"on the seven projections), 2 ranks, fp32 compute and reduction, AdamW with clipping, seq_len "
             f"{r['seq_len']}, 1 sample per rank per step, {r['steps']} steps. What differs: only "
             "`lora.replicate_adapters`. Bytes: what rank 0 sent in the last step; reductions are reduce-scatters plus "
             "all-reduces (the small ones of clipping and the finite check included); the plan's from fsdp-plan with "
             "the same settings.", "",
             "| adapters | r | all-gather sent (MiB/step) | planned | reductions sent (MiB/step) | planned | peak RSS "
             "per rank, process (MiB) | plan per rank (MiB) | step time (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        gathered, reduced = bytes_row(run)
        lines.append(f"| {run.get('mode', name)} | {run.get('lora_r', ranks[0])} | {gathered:.2f} | "
                     f"{run['plan_allgather_mib']} | {reduced:.2f} | {run['plan_reduce_mib']} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['peak_rss_process_mib'])} | "
                     f"{run['plan_device_mib']:,.0f} | {run['step_time_s']:.2f} |")
    lines.append("")
    for rank in ranks:
        a = r["runs"].get(f"sharded r={rank}", r["runs"].get("sharded"))
        b = r["runs"].get(f"replicated r={rank}", r["runs"].get("replicated"))
        extra_plan = b["plan_device_mib"] - a["plan_device_mib"]
        extra = statistics.mean(b["peak_rss_process_mib"]) - statistics.mean(a["peak_rss_process_mib"])
        per_rank = [y - x for x, y in zip(a["peak_rss_process_mib"], b["peak_rss_process_mib"])]
        lines += [f"- r={rank}: step time {b['step_time_s'] / a['step_time_s']:.3f}x the sharded adapters'; the "
                  f"process's peak {extra:+,.0f} MiB per rank (the ranks' mean; "
                  f"{', '.join(f'{x:+,.0f}' for x in per_rank)} by rank) against {extra_plan:+,.0f} MiB planned "
                  f"({extra / extra_plan:.2f}x)."]
    lines += ["- What the plan adds: the adapters' master, gradient and moments whole (16 bytes per element) less "
              "their shards; in fp32 compute a replicated adapter is its own master, so its gathered copy goes.",
              "- Why two ranks: where the allocator places the step's buffers moves a rank's peak by a few tens of "
              "MiB from run to run, whatever the adapters' size (at r=64, three runs measured +248, +191 and +228 MiB "
              "per rank against +257 planned). At r=16 the effect is of that order; the larger rank is where the "
              "memory effect can be read.",
              f"- Losses: largest relative difference {r['loss_rel_gap']:.1e} (rounding: the all-reduce sums in "
              "another order than the reduce-scatter).", ""]
    return lines


# ---- reshard-group

def reshard_group(args, work):
    model = ["--set", "model.vocab_size=2048", "--set", "model.hidden_size=512", "--set", "model.intermediate_size=1536",
             "--set", "model.num_hidden_layers=8", "--set", "model.num_attention_heads=8",
             "--set", "model.num_key_value_heads=8", "--set", "data.seq_len=128"]
    setup = ["--steps", str(args.steps), "--set", "data.batch_size_per_rank=2"]
    result = {"lever": "reshard-group", "commit": commit(), "quiet": args.quiet,
              "command": " ".join(["bench/levers_bench.py"] + sys.argv[1:]), "steps": args.steps, "runs": {}}
    empty = os.path.join(work, "config.json")
    with open(empty, "w") as f:
        f.write("{}\n")
    for group in ("0", "2", "1"):
        name = {"0": "reshard (0)", "2": "groups of 2", "1": "keep (1)"}[group]
        sets = model + ["--set", f"fsdp.reshard_after_forward_group={group}"]
        run = fsdp_train(args, work, f"group{group}", 4, sets + setup)
        metrics = [json.loads(line) for line in open(os.path.join(work, f"group{group}.jsonl")) if '"eval' not in line]
        run["group_allgather_bytes"] = [m.get("group_allgather_bytes", [0])[0] for m in metrics]
        run.update(plan_figures(args, 4, ["--config", empty, *sets, "--set", "data.batch_size_per_rank=2"]))
        result["runs"][name] = run
        print(json.dumps(run), flush=True)
    ref = result["runs"]["reshard (0)"]["losses"]
    for run in result["runs"].values():
        run["loss_rel_diff"] = rel_gap(run["losses"], ref)
    return result


def reshard_group_md(r):
    lines = ["## Resharding after forward to a node's group (`fsdp.reshard_after_forward_group`, "
             "`FullyShardOptions::reshard_after_forward_group`)", "",
             f"- Commit: {r['commit']}. Machine: this one, 2 cores, no GPU; 4 ranks (two per core) as 2 simulated "
             "nodes of 2: the groups of 2 are ranks {0, 1} and {2, 3}, so what the whole shard group's all-gather "
             "sends stands for inter-node traffic. Threads: `OMP_NUM_THREADS=1` per rank. Transport: shared memory. "
             f"Quiet: {r['quiet']}.", f"- Command: `{r['command']}`", "",
             "A Llama of hidden size 512, 8 layers and a vocabulary of 2048, fp32, FULL_SHARD over 4 ranks, AdamW with "
             f"clipping, seq_len 128, 2 samples per rank per step, {r['steps']} steps. What differs: only the "
             "layers' `fsdp.reshard_after_forward_group` (0: reshard to nothing, 1: keep the gathered layer, as "
             "reshard_after_forward false). Bytes: what rank 0 sent in the last step.", "",
             "| layers after forward | all-gather, whole group (MiB/step) | inside the node group (MiB/step) | "
             "planned (whole / node) | peak RSS per rank, process (MiB) | plan per rank (MiB) | step time (s) | "
             "max relative loss difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        group = run["group_allgather_bytes"][-1] / MIB
        whole = run["allgather_bytes"][-1] / MIB - group
        pg = run["plan_group_allgather_mib"]
        lines.append(f"| {name} | {whole:.2f} | {group:.2f} | {run['plan_allgather_mib'] - pg:.2f} / {pg:.2f} | "
                     f"{' / '.join(f'{x:,.0f}' for x in run['peak_rss_process_mib'])} | {run['plan_device_mib']:,.0f} | "
                     f"{run['step_time_s']:.3f} | {run['loss_rel_diff']:.1e} |")
    a, g, k = r["runs"]["reshard (0)"], r["runs"]["groups of 2"], r["runs"]["keep (1)"]
    cross = lambda run: run["allgather_bytes"][-1] - run["group_allgather_bytes"][-1]
    peak = lambda run: statistics.mean(run["peak_rss_process_mib"])  # the ranks' mean: one rank's is noisier
    lines += ["",
              f"- Whole-group (inter-node) all-gather bytes: {cross(g) / cross(a):.3f}x resharding to nothing, the "
              f"same as keeping ({cross(k) / cross(a):.3f}x); backward's gathers run inside the node instead.",
              f"- Memory, plan per rank: {g['plan_device_mib'] - a['plan_device_mib']:+,.0f} MiB against resharding "
              f"to nothing, {g['plan_device_mib'] - k['plan_device_mib']:+,.0f} MiB against keeping; measured peak "
              f"(the ranks' mean): {peak(g) - peak(a):+,.0f} and {peak(g) - peak(k):+,.0f} MiB "
              f"({(peak(g) - peak(a)) / (g['plan_device_mib'] - a['plan_device_mib']):.2f}x the planned effect "
              "against resharding to nothing, the run without the lever).",
              f"- Step time: {g['step_time_s'] / a['step_time_s']:.2f}x resharding to nothing (one machine: the node "
              "link and the inter-node link are the same shared memory here, so the time saved on a real network "
              "is not shown).", ""]
    return lines


# ---- hsdp-accum

def hsdp_accum(args, work):
    model = ["--set", "model.vocab_size=2048", "--set", "model.hidden_size=256", "--set", "model.intermediate_size=768",
             "--set", "model.num_hidden_layers=4", "--set", "model.num_attention_heads=4",
             "--set", "model.num_key_value_heads=4", "--set", "data.seq_len=128"]
    setup = ["--steps", str(args.steps), "--set", "fsdp.strategy=HYBRID_SHARD", "--set", "fsdp.replicate=2",
             "--set", "data.batch_size_per_rank=2", "--set", "train.grad_accum_steps=4"]
    result = {"lever": "hsdp-accum", "commit": commit(), "quiet": args.quiet,
              "command": " ".join(["bench/levers_bench.py"] + sys.argv[1:]), "steps": args.steps, "runs": {}}
    empty = os.path.join(work, "config.json")  # fsdp-plan plans a config: the defaults, set below
    with open(empty, "w") as f:
        f.write("{}\n")
    for how in ("reduce", "reduce_scatter", "no_sync"):
        run = fsdp_train(args, work, how, 4, model + setup + ["--set", f"train.accumulation={how}"])
        plan = subprocess.run([os.path.join(args.bin, "fsdp-plan"), "--config", empty, "--nproc-per-node", "4", *model,
                               *setup[2:],
                               "--set", f"train.accumulation={how}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        m = re.search(r"reductions send ([\d.]+) MiB", plan.stdout)
        run["plan_reduce_mib"] = float(m.group(1)) if m else None
        result["runs"][how] = run
        print(json.dumps(run), flush=True)
    ref = result["runs"]["reduce"]["losses"]
    for how, run in result["runs"].items():
        run["loss_rel_diff"] = rel_gap(run["losses"], ref)
    return result


def hsdp_md(r):
    lines = ["## Accumulation under HYBRID_SHARD without the all-reduce per micro-batch (`train.accumulation`, "
             "`FSDPModule::set_requires_all_reduce`)", "",
             f"- Commit: {r['commit']}. Machine: this one, 2 cores, no GPU; 4 ranks (two per core) as 2 replicas of "
             "2 shards, so the replicas' group stands for the inter-node link. Threads: `OMP_NUM_THREADS=1` per "
             f"rank. Transport: shared memory. Quiet: {r['quiet']}.", f"- Command: `{r['command']}`", "",
             "A Llama of hidden size 256, 4 layers and a vocabulary of 2048, fp32, AdamW with clipping, "
             f"seq_len 128, 4 micro-batches of 2 samples per rank per step, {r['steps']} steps. What differs: only "
             "`train.accumulation`. Bytes are those rank 0 sent per step (the last step), by collective; "
             "all-reduce includes the small ones (the clipping norm, the finite check) that every mode runs.", "",
             "| accumulation | all-reduce sent (MiB/step) | reduce-scatter sent (MiB/step) | all-gather sent (MiB/step) | "
             "reductions planned (MiB/step) | measured / plan | partial sums, plan vs measured | peak RSS, rank 0 "
             "(MiB) | step time (s) | max relative loss difference vs reduce |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for how, run in r["runs"].items():
        sent = (run["all_reduce_bytes"][-1] + run["reduce_scatter_bytes"][-1]) / MIB
        plan = run["plan_reduce_mib"]
        partial = re.search(r"partial_gradient_sums ([\d.]+ vs [\d.]+ MiB \([-+\d.]+%\))", run["levers"] or "")
        lines.append(f"| {how} | {run['all_reduce_bytes'][-1] / MIB:.2f} | {run['reduce_scatter_bytes'][-1] / MIB:.2f} | "
                     f"{run['allgather_bytes'][-1] / MIB:.2f} | {plan:.2f} | {sent / plan:.3f} | "
                     f"{partial.group(1) if partial else '-'} | {run['peak_rss_process_mib'][0]:,.0f} | "
                     f"{run['step_time_s']:.3f} | {run['loss_rel_diff']:.1e} |")
    red, rs = r["runs"]["reduce"], r["runs"]["reduce_scatter"]
    saved = (red["all_reduce_bytes"][-1] - rs["all_reduce_bytes"][-1]) / MIB
    lines += ["", f"- The replicas' all-reduce: {saved:.2f} MiB less per step and per rank with reduce_scatter "
              f"than with reduce ({rs['all_reduce_bytes'][-1] / red['all_reduce_bytes'][-1]:.3f}x), the "
              "reduce-scatters unchanged; no_sync sends least but keeps every unit's unsharded gradient between "
              "micro-batches (the plan's 'unreduced gradients across micro-batches').",
              f"- Step time, reduce_scatter / reduce: {rs['step_time_s'] / red['step_time_s']:.2f} (on one machine "
              "the replicas' link is shared memory, not a network: the saving in time here is small by "
              "construction).", ""]
    return lines


def chunked_loss_md(r):
    """The chunked loss's effect, from bench/chunked_loss_bench.py's results (its own file has the detail)."""
    lines = ["## A loss chunked over the tokens (`train.loss_chunk_tokens`, `fsdp::chunked_cross_entropy`)", "",
             f"- From bench/results/chunked_loss-{r['model']}.md (commit {r['commit']}; command "
             f"`{r['command']}`): {r['model']}, 2 ranks, {r['dtype']} compute, seq_len {r['seq_len']}, chunks of "
             f"{r['chunk']} tokens, {r['steps']} steps. Conditions as stated there.", "",
             "| run | peak RSS over the steps, ranks' mean (MiB) | effect (MiB) | planned effect (MiB) | measured / "
             "planned | step time, chunked / whole |", "| --- | --- | --- | --- | --- | --- |"]
    for base in ("full", "lora-nf4"):
        a, b = r["runs"][base], r["runs"][base + "-chunked"]
        measured = statistics.mean(b["peak_rss_steps_mib"]) - statistics.mean(a["peak_rss_steps_mib"])
        planned = b["plan_device_mib"] - a["plan_device_mib"]
        lines.append(f"| {base} | {statistics.mean(a['peak_rss_steps_mib']):,.0f} -> "
                     f"{statistics.mean(b['peak_rss_steps_mib']):,.0f} | {measured:+,.0f} | {planned:+,.0f} | "
                     f"{measured / planned:.2f} | {b['step_time_s'] / a['step_time_s']:.2f} |")
    return lines + [""]


def write_md(out_dir):
    parts = ["# Levers against the run without them", "",
             "Each section: one lever of the library (and its fsdp-train key) against the same run without it, on "
             "this machine, with the command that measured it (bench/levers_bench.py) and its conditions.", ""]
    for lever, fn in (("bf16-state", bf16_state_md), ("keep-gathered", keep_gathered_md), ("hsdp-accum", hsdp_md),
                      ("replicated-adapters", replicated_md), ("reshard-group", reshard_group_md)):
        path = os.path.join(out_dir, f"levers-{lever}.json")
        if os.path.exists(path):
            parts += fn(json.load(open(path)))
    chunked = os.path.join(out_dir, "chunked_loss-qwen2.5-0.5b.json")
    if os.path.exists(chunked):
        parts += chunked_loss_md(json.load(open(chunked)))
    open(os.path.join(out_dir, "levers.md"), "w").write("\n".join(parts) + "\n")
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lever", choices=["bf16-state", "keep-gathered", "hsdp-accum", "replicated-adapters",
                                      "reshard-group", "report"])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--drop-caches", action="store_true",
                    help="empty the page cache before each run (the RSS's file-backed part then starts alike)")
    ap.add_argument("--lora-r", type=int, default=16, help="the adapters' rank (alpha is twice it)")
    ap.add_argument("--ranks", default="16,256", help="replicated-adapters: the adapters' ranks to compare at")
    ap.add_argument("--curve-steps", type=int, default=300)
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--quiet", default="not recorded", help="what else ran on the machine, for the report")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    if args.lever != "report":
        work = tempfile.mkdtemp(prefix="fsdp-levers-bench-")
        try:
            result = {"bf16-state": bf16_state, "keep-gathered": keep_gathered, "hsdp-accum": hsdp_accum,
                      "replicated-adapters": replicated_adapters, "reshard-group": reshard_group}[args.lever](args, work)
        finally:
            subprocess.run(["rm", "-rf", work], check=False)
        os.makedirs(args.out_dir, exist_ok=True)
        json.dump(result, open(os.path.join(args.out_dir, f"levers-{args.lever}.json"), "w"), indent=1)
    print(write_md(args.out_dir))
    if args.lever == "bf16-state" and result["loss_rel_gap"] > args.tol:
        raise SystemExit(f"levers_bench: bf16 moments' losses differ by {result['loss_rel_gap']:.2e} > {args.tol}")
    if args.lever == "keep-gathered" and result["loss_rel_gap"] > 0:
        raise SystemExit(f"levers_bench: kept gathers changed the losses ({result['loss_rel_gap']:.2e})")
    if args.lever == "replicated-adapters" and result["loss_rel_gap"] > 1e-5:
        raise SystemExit(f"levers_bench: replicated adapters' losses differ by {result['loss_rel_gap']:.2e}: not the same work")
    if args.lever == "reshard-group":
        bad = [n for n, r in result["runs"].items() if r["loss_rel_diff"] > 0]
        if bad:
            raise SystemExit(f"levers_bench: {bad} changed the losses: resharding to a group must be exact")
    if args.lever == "hsdp-accum":
        bad = [h for h, r in result["runs"].items() if r["loss_rel_diff"] > 1e-5]
        if bad:
            raise SystemExit(f"levers_bench: {bad} differ from reduce's losses: not the same work")


if __name__ == "__main__":
    main()
