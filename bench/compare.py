"""`scripts/bench compare`: fsdp vs PyTorch FSDP2 vs unsharded LibTorch, same model, init, data, run.

For each config (communication-bound and compute-bound Llama, fp32) it prepares, once: fsdp-train's
step-0 checkpoint, its Hugging Face export (config.json + weights for FSDP2) and the training
batches for each world size (bench_unsharded --dump-data). Then, in interleaved repeats, it runs
  fsdp     fsdp-train, FULL_SHARD, on 1, 2 and 4 ranks
  fsdp2    bench/compare_fsdp2.py (transformers' LlamaForCausalLM + FSDP2) on 1, 2 and 4 ranks
  libtorch bench_unsharded (plain LibTorch, torch::optim::AdamW) on 1 rank
with the same intra-op threads per rank for all (cores / ranks, at least 1), and reads their
--metrics lines. Per run: median step time after the warm-up steps (and across repeats: the
median of run medians, min..max as the spread), tokens/s, peak RSS per rank, bytes sent per rank
per step, time blocked in communication, and the first steps' losses.

Writes bench/results/compare.json, compare.md and compare.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "comm": {
        "title": "communication-bound (hidden 256, 4 layers, seq 64, batch 1 per rank)",
        "args": ["--set", "model.hidden_size=256", "--set", "model.intermediate_size=688",
                 "--set", "model.num_hidden_layers=4", "--set", "model.num_attention_heads=8",
                 "--set", "model.num_key_value_heads=8", "--set", "data.seq_len=64",
                 "--set", "data.batch_size_per_rank=1"],
    },
    "compute": {
        "title": "compute-bound (hidden 512, 6 layers, seq 256, batch 4 per rank)",
        "args": ["--set", "model.hidden_size=512", "--set", "model.intermediate_size=1376",
                 "--set", "model.num_hidden_layers=6", "--set", "model.num_attention_heads=8",
                 "--set", "model.num_key_value_heads=8", "--set", "data.seq_len=256",
                 "--set", "data.batch_size_per_rank=4"],
    },
}
COMMON = ["--set", "train.eval_every=0", "--set", "optim.warmup_steps=2", "--set", "train.log_every=1000"]
SYSTEMS = ("fsdp", "fsdp2", "libtorch")


def run(cmd, env=None, timeout=1800):
    t0 = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:])
        raise SystemExit(f"compare: failed (exit {p.returncode}): {' '.join(cmd)}")
    return time.time() - t0


def read_metrics(path):
    return [json.loads(l) for l in open(path) if l.strip() and not json.loads(l).get("eval")]


def summarize(rows, warmup, world):
    steady = rows[warmup:]
    med = lambda xs: statistics.median(xs)
    step = med([r["step_time_s"] for r in steady])
    return {
        "step_time_s": step,
        "comm_wait_s": med([max(r["comm_wait_s"]) for r in steady]),  # the slowest rank's blocked time
        "bytes_per_rank": med([r["allgather_bytes"][0] + r["reduce_scatter_bytes"][0] for r in steady]),
        "peak_rss_bytes": max(max(r["peak_rss_bytes"]) for r in rows),  # the largest rank's peak
        "losses": [r["loss"] for r in rows[:5]],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build/bin")
    ap.add_argument("--python", default=".venv/bin/python")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--configs", default="comm,compute")
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("FSDP_BENCH_REPEATS", "2")))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", default="comm=12,compute=6", help="steps per run, per config (warm-up included)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    configs = args.configs.split(",")
    steps = dict(kv.split("=") for kv in args.steps.split(","))
    cores = os.cpu_count() or 1
    b = args.build
    tmp = tempfile.mkdtemp(prefix="fsdp-compare-")

    # Once per config: the step-0 checkpoint (the initial weights every system starts from), its
    # Hugging Face export, and the batches of each world size.
    prep = {}
    for cfg in configs:
        n = int(steps[cfg])
        cargs = CONFIGS[cfg]["args"] + COMMON + ["--steps", str(n)]
        d = os.path.join(tmp, cfg)
        os.makedirs(d)
        run([f"{b}/fsdp-train"] + CONFIGS[cfg]["args"] + COMMON + ["--steps", "0", "--save-dir", f"{d}/ckpt"])
        ckpt = f"{d}/ckpt/step-00000000"
        run([f"{b}/fsdp-ckpt", "export", ckpt, f"{d}/hf"])
        for w in worlds:
            run([f"{b}/bench_unsharded"] + cargs + ["--dump-data", f"{d}/data-w{w}.bin", "--world", str(w)])
        prep[cfg] = {"args": cargs, "ckpt": ckpt, "hf": f"{d}/hf", "dir": d, "steps": n}

    runs = []  # one record per (config, system, world, repeat)
    for repeat in range(args.repeats):
        for cfg in configs:
            p = prep[cfg]
            for w in worlds:
                threads = max(1, cores // w)
                env = dict(os.environ, FSDP_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
                for system in SYSTEMS:
                    if system == "libtorch" and w != 1:
                        continue
                    metrics = f"{p['dir']}/{system}-w{w}-r{repeat}.jsonl"
                    if system == "fsdp":
                        cmd = [f"{b}/fsdp-run", "--nproc-per-node", str(w), "--", f"{b}/fsdp-train"] + p["args"] + \
                              ["--metrics", metrics]
                    elif system == "fsdp2":
                        cmd = [f"{b}/fsdp-run", "--nproc-per-node", str(w), "--", args.python, "bench/compare_fsdp2.py",
                               "--hf", p["hf"], "--checkpoint", p["ckpt"], "--data", f"{p['dir']}/data-w{w}.bin",
                               "--data-world", str(w), "--steps", str(p["steps"]), "--threads", str(threads),
                               "--metrics", metrics]
                    else:
                        cmd = [f"{b}/bench_unsharded"] + p["args"] + ["--metrics", metrics]
                    wall = run(cmd, env=env)
                    rec = {"config": cfg, "system": system, "world": w, "repeat": repeat, "threads_per_rank": threads,
                           "oversubscribed": w * threads > cores, "wall_s": wall}
                    rec.update(summarize(read_metrics(metrics), args.warmup, w))
                    runs.append(rec)
                    print(f"compare: {cfg} {system} world {w} repeat {repeat}: "
                          f"{rec['step_time_s'] * 1e3:.1f} ms/step, peak RSS {rec['peak_rss_bytes'] / 2**20:.0f} MiB",
                          flush=True)

    # Across repeats: the median of the runs' medians, min..max as the spread.
    table = []
    for cfg in configs:
        for w in worlds:
            for system in SYSTEMS:
                rs = [r for r in runs if r["config"] == cfg and r["world"] == w and r["system"] == system]
                if not rs:
                    continue
                st = [r["step_time_s"] for r in rs]
                tokens = prep[cfg]
                row = {
                    "config": cfg, "system": system, "world": w, "threads_per_rank": rs[0]["threads_per_rank"],
                    "oversubscribed": rs[0]["oversubscribed"], "repeats": len(rs),
                    "step_time_s": statistics.median(st), "step_time_min_s": min(st), "step_time_max_s": max(st),
                    "comm_wait_s": statistics.median([r["comm_wait_s"] for r in rs]),
                    "bytes_per_rank": statistics.median([r["bytes_per_rank"] for r in rs]),
                    "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                    "losses": rs[0]["losses"],
                }
                seq = int(_arg(tokens["args"], "data.seq_len"))
                batch = int(_arg(tokens["args"], "data.batch_size_per_rank"))
                row["tokens_per_s"] = seq * batch * w / row["step_time_s"]
                table.append(row)

    ratios = {}
    find = lambda c, s, w: next((r for r in table if r["config"] == c and r["system"] == s and r["world"] == w), None)
    for cfg in configs:
        for w in worlds:
            a, f2 = find(cfg, "fsdp", w), find(cfg, "fsdp2", w)
            if a and f2:
                ratios[f"{cfg}/w{w}/step_time_fsdp_over_fsdp2"] = a["step_time_s"] / f2["step_time_s"]
                ratios[f"{cfg}/w{w}/peak_rss_fsdp_over_fsdp2"] = a["peak_rss_bytes"] / f2["peak_rss_bytes"]
        a, lt = find(cfg, "fsdp", 1), find(cfg, "libtorch", 1)
        if a and lt:
            ratios[f"{cfg}/w1/step_time_fsdp_over_libtorch"] = a["step_time_s"] / lt["step_time_s"]
        # Do they do the same work? At each world size, the first steps' losses of every system
        # against fsdp's (the same global batch whatever the system).
        for w in worlds:
            a = find(cfg, "fsdp", w)
            if not a:
                continue
            diffs = [abs(x - y) for s in ("fsdp2", "libtorch") if find(cfg, s, w)
                     for x, y in zip(find(cfg, s, w)["losses"], a["losses"])]
            if diffs:
                ratios[f"{cfg}/w{w}/max_abs_loss_diff_first_steps"] = max(diffs)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"cores": cores, "warmup_steps": args.warmup, "steps": steps, "repeats": args.repeats,
                   "table": table, "ratios": ratios, "runs": runs}, f, indent=2)
    md = markdown(table, ratios, configs, cores, args)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(md)
    plot(table, configs, worlds, os.path.join(args.out, "compare.png"))
    print(md)


def _arg(args, key):
    for i, a in enumerate(args):
        if a == "--set" and args[i + 1].startswith(key + "="):
            return args[i + 1].split("=", 1)[1]
    raise KeyError(key)


def markdown(table, ratios, configs, cores, args):
    names = {"fsdp": "fsdp (FULL_SHARD)", "fsdp2": "PyTorch FSDP2", "libtorch": "unsharded LibTorch"}
    out = [
        f"fsdp vs PyTorch FSDP2 vs unsharded LibTorch on this machine ({cores} cores), fp32, CPU over Gloo.",
        f"Median step time after {args.warmup} warm-up steps: median over {args.repeats} interleaved repeats "
        "(spread = min..max of the repeats' medians). Threads per rank = cores / ranks (at least 1); "
        "4 ranks on 2 cores are oversubscribed.",
        "Bytes sent per rank per step: fsdp from its counters; FSDP2 from a wrapper on its collective calls "
        "(ring bytes (N-1)/N of each gathered / reduced buffer). Blocked = time in communication waits "
        "(slowest rank). Losses: the first 3 steps.",
        "",
    ]
    for cfg in configs:
        out += [f"### {CONFIGS[cfg]['title']}", "",
                "| ranks | system | step time | spread | tokens/s | peak RSS / rank | sent / rank / step | blocked / step | first losses |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in table:
            if r["config"] != cfg:
                continue
            w = f"{r['world']}" + (" (oversubscribed)" if r["oversubscribed"] else "")
            out.append(
                f"| {w} | {names[r['system']]} | {r['step_time_s'] * 1e3:.1f} ms | "
                f"{r['step_time_min_s'] * 1e3:.1f}..{r['step_time_max_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                f"{r['peak_rss_bytes'] / 2**20:.0f} MiB | {r['bytes_per_rank'] / 2**20:.2f} MiB | "
                f"{r['comm_wait_s'] * 1e3:.1f} ms | {', '.join(f'{x:.4f}' for x in r['losses'][:3])} |")
        out.append("")
    out += ["### Ratios", "", "| ratio | value |", "|---|---|"]
    out += [f"| {k} | {v:.3g} |" for k, v in ratios.items()]
    return "\n".join(out) + "\n"


def plot(table, configs, worlds, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(configs), figsize=(6 * len(configs), 8), squeeze=False)
    for j, cfg in enumerate(configs):
        for system, marker in (("fsdp", "o"), ("fsdp2", "s"), ("libtorch", "^")):
            rows = sorted((r for r in table if r["config"] == cfg and r["system"] == system), key=lambda r: r["world"])
            if not rows:
                continue
            ws = [r["world"] for r in rows]
            axes[0][j].errorbar(ws, [r["step_time_s"] * 1e3 for r in rows],
                                yerr=[[(r["step_time_s"] - r["step_time_min_s"]) * 1e3 for r in rows],
                                      [(r["step_time_max_s"] - r["step_time_s"]) * 1e3 for r in rows]],
                                marker=marker, label=system, capsize=3)
            axes[1][j].plot(ws, [r["peak_rss_bytes"] / 2**20 for r in rows], marker=marker, label=system)
        axes[0][j].set_title(CONFIGS[cfg]["title"], fontsize=9)
        axes[0][j].set_ylabel("median step time (ms)")
        axes[1][j].set_ylabel("peak RSS per rank (MiB)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xlabel("ranks (4 = oversubscribed on 2 cores)")
            ax.set_xticks(worlds)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
