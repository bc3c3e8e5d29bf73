"""`scripts/bench compare`: fsdp vs PyTorch FSDP2 vs unsharded LibTorch, same model, init, data, run.

For each config (communication-bound and compute-bound Llama, fp32) it prepares, once: fsdp-train's
step-0 checkpoint, its Hugging Face export (config.json + weights for FSDP2) and the training
batches for each world size (bench_unsharded --dump-data). Then, in interleaved repeats, it runs
  fsdp      fsdp-train, FULL_SHARD, on 1, 2 and 4 ranks, collectives over its shared-memory
            transport (the default between the ranks of one host)
  fsdp_gloo the same fsdp-train with FSDP_CPU_TRANSPORT=gloo: its collectives over Gloo, the
            transport FSDP2 uses, on 2 and 4 ranks (on 1 rank there is nothing to send)
  fsdp2     bench/compare_fsdp2.py (transformers' LlamaForCausalLM + FSDP2, fused AdamW) on 1, 2 and
            4 ranks, collectives through torch.distributed's Gloo backend (ProcessGroupGloo)
  libtorch  bench_unsharded (plain LibTorch, fsdp's fused AdamW kernel on unsharded parameters) on
            1 rank, once per distinct thread count of the world sizes
with the same intra-op threads per rank for all (cores / ranks, at least 1), the same optimizer
(AdamW, weight decay on >= 2-D parameters only, same schedule, clipping) and the same attention
(fsdp-train's model.attn_implementation: sdpa by default), and reads their --metrics lines. Per run: median step time after the warm-up steps (and
across repeats: the median of run medians, min..max as the spread), tokens/s, peak RSS per rank,
bytes sent per rank per step, time blocked in communication, and the first steps' losses.

Same work: at each world size and in every repeat, the first 5 losses of FSDP2 (and of unsharded
LibTorch on 1 rank, whose batch is then the global one) must equal fsdp's within 1e-4; otherwise
compare.py names the system, step and values and exits with status 1 before writing any result.

Memory: each system's peak RSS is reported as the process peak and as the peak above that
system's own no-model baseline: the same program run with --init-only on the same ranks and
threads (libraries imported, process group and mesh made, data ready, no model built), each
rank's peak minus its own baseline, the largest over ranks.

Scaling efficiency at N ranks = step time of one unsharded LibTorch rank on the same per-rank batch
with the same threads (cores / N) / step time on N ranks: 1.0 means communication and sharding
cost nothing. Reported for fsdp (and, for reference, FSDP2).

Where the step goes: for fsdp (both transports) and unsharded LibTorch, rank 0's time per part of
the step (forward, backward, check_finite, clip, optimizer, the rest), the time blocked in
communication, and the copy floor (2 x bytes sent / one core's memcpy bandwidth, measured in the
same run).

Writes OUT/compare.json, compare.md and compare.png (OUT: bench/results by default).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ab_step_time import MALLOC_TUNABLES  # the same malloc thresholds for every system

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
SYSTEMS = ("fsdp", "fsdp_gloo", "fsdp2", "libtorch")
NAMES = {"fsdp": "fsdp (FULL_SHARD, shared memory)", "fsdp_gloo": "fsdp (FULL_SHARD, Gloo)",
         "fsdp2": "PyTorch FSDP2 (Gloo)", "libtorch": "unsharded LibTorch"}
# The transport each system's collectives use, named in compare.md's header.
TRANSPORTS = {"fsdp": "fsdp's shared-memory ring (FSDP_CPU_TRANSPORT unset: the default within a host)",
              "fsdp_gloo": "Gloo through fsdp's communicator (FSDP_CPU_TRANSPORT=gloo)",
              "fsdp2": "torch.distributed's Gloo backend (ProcessGroupGloo)",
              "libtorch": "none (one rank)"}
LOSS_STEPS = 5     # the first steps whose losses must agree
LOSS_TOL = 1e-4    # absolute


def run(cmd, env=None, timeout=1800):
    t0 = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:])
        raise SystemExit(f"compare: failed (exit {p.returncode}): {' '.join(cmd)}")
    return time.time() - t0


def read_lines(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def read_metrics(path):
    return [r for r in read_lines(path) if not r.get("eval") and not r.get("init_only")]


def read_baseline(path):
    """Each rank's peak RSS from an --init-only run."""
    rows = [r for r in read_lines(path) if r.get("init_only")]
    if not rows:
        raise SystemExit(f"compare: no init_only line in {path}")
    return rows[0]["peak_rss_bytes"]


def summarize(rows, warmup, baseline):
    # A functional run with fewer steps than the warm-up still gives a (noisy) figure.
    steady = rows[warmup:] or rows
    med = lambda xs: statistics.median(xs)
    ranks = len(rows[0]["peak_rss_bytes"])
    peaks = [max(r["peak_rss_bytes"][k] for r in rows) for k in range(ranks)]
    return {
        "step_time_s": med([r["step_time_s"] for r in steady]),
        "comm_wait_s": med([max(r["comm_wait_s"]) for r in steady]),  # the slowest rank's blocked time
        "bytes_per_rank": med([r["allgather_bytes"][0] + r["reduce_scatter_bytes"][0] for r in steady]),
        "peak_rss_bytes": max(peaks),  # the largest rank's process peak
        "baseline_rss_bytes": max(baseline),
        "peak_rss_above_baseline_bytes": max(p - b for p, b in zip(peaks, baseline)),
        "losses": [r["loss"] for r in rows[:LOSS_STEPS]],
        # Rank 0's seconds per part of the step (fsdp-train's and bench_unsharded's phase_s).
        "phase_s": {k: med([r["phase_s"][k] for r in steady]) for k in steady[0].get("phase_s", {})},
    }


MEMCPY = """
import statistics, time, torch
torch.set_num_threads(1)
src, dst = torch.ones(16 << 20), torch.empty(16 << 20)  # 64 MiB each: beyond the caches
times = []
for _ in range(20):
    t0 = time.perf_counter(); dst.copy_(src); times.append(time.perf_counter() - t0)
print(src.numel() * 4 / statistics.median(times))
"""


def memcpy_bandwidth(python):
    """Bytes per second one core copies between two 64 MiB buffers (median of 20 copies)."""
    p = subprocess.run([python, "-c", MEMCPY], stdout=subprocess.PIPE, text=True, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return float(p.stdout.strip())


def loss_mismatches(cfg, w, repeat, recs):
    """Messages for every system whose first losses differ from fsdp's by more than LOSS_TOL."""
    ref = recs.get("fsdp")
    if ref is None:
        return []
    out = []
    for system, rec in recs.items():
        # Unsharded LibTorch trains on one rank's batch: the global batch only at world size 1.
        if system == "fsdp" or (system == "libtorch" and w != 1):
            continue
        n = min(len(rec["losses"]), len(ref["losses"]))
        for i in range(n):
            d = abs(rec["losses"][i] - ref["losses"][i])
            if not d <= LOSS_TOL:
                out.append(f"compare: {cfg}, {w} rank(s), repeat {repeat}: {system} step {i + 1} loss "
                           f"{rec['losses'][i]:.6f} vs fsdp {ref['losses'][i]:.6f} (|diff| {d:.2e} > {LOSS_TOL:g})")
    return out


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
    threads_of = {w: max(1, cores // w) for w in worlds}

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

    def env_for(threads, system):
        env = dict(os.environ, FSDP_THREADS=str(threads), OMP_NUM_THREADS=str(threads), GLIBC_TUNABLES=MALLOC_TUNABLES)
        env.pop("FSDP_CPU_TRANSPORT", None)
        if system == "fsdp_gloo":
            env["FSDP_CPU_TRANSPORT"] = "gloo"
        return env

    def runs_at(system, w):
        return not (system == "fsdp_gloo" and w == 1)  # one rank sends nothing: the transport is unused

    def command(system, p, w, threads, metrics, init_only):
        extra = ["--init-only"] if init_only else []
        if system in ("fsdp", "fsdp_gloo"):
            return [f"{b}/fsdp-run", "--nproc-per-node", str(w), "--timeout-s", "600", "--", f"{b}/fsdp-train"] + p["args"] + \
                   ["--metrics", metrics] + extra
        if system == "fsdp2":
            return [f"{b}/fsdp-run", "--nproc-per-node", str(w), "--timeout-s", "600", "--", args.python, "bench/compare_fsdp2.py",
                    "--hf", p["hf"], "--checkpoint", p["ckpt"], "--data", f"{p['dir']}/data-w{w}.bin",
                    "--data-world", str(w), "--steps", str(p["steps"]), "--threads", str(threads),
                    "--metrics", metrics] + extra
        return [f"{b}/bench_unsharded"] + p["args"] + ["--metrics", metrics] + extra

    # Each system's own memory baseline, once per config, world size (libtorch: thread count).
    baselines = {}
    for cfg in configs:
        p = prep[cfg]
        for w in worlds:
            for system in SYSTEMS:
                key = (cfg, system, 1 if system == "libtorch" else w, threads_of[w])
                if key in baselines or not runs_at(system, w):
                    continue
                path = f"{p['dir']}/{system}-w{key[2]}-t{key[3]}-baseline.jsonl"
                run(command(system, p, key[2], key[3], path, init_only=True), env=env_for(key[3], system))
                baselines[key] = read_baseline(path)
                print(f"compare: {cfg} {system} {key[2]} rank(s), {key[3]} thread(s): baseline peak RSS "
                      f"{max(baselines[key]) / 2**20:.0f} MiB", flush=True)

    runs = []  # one record per (config, system, world, repeat); libtorch's stands for world N
    for repeat in range(args.repeats):
        for cfg in configs:
            p = prep[cfg]
            for w in worlds:
                threads = threads_of[w]
                recs = {}
                for system in SYSTEMS:
                    if not runs_at(system, w):
                        continue
                    ranks = 1 if system == "libtorch" else w
                    rec = {"config": cfg, "system": system, "world": w, "ranks": ranks, "repeat": repeat,
                           "threads_per_rank": threads, "oversubscribed": ranks * threads > cores}
                    same = next((r for r in runs if r["config"] == cfg and r["system"] == system and
                                 r["repeat"] == repeat and r["threads_per_rank"] == threads), None)
                    if system == "libtorch" and same is not None:
                        # One unsharded rank with these threads already ran this repeat (another N).
                        rec.update({k: v for k, v in same.items() if k not in rec})
                    else:
                        metrics = f"{p['dir']}/{system}-w{w}-r{repeat}.jsonl"
                        rec["wall_s"] = run(command(system, p, w, threads, metrics, init_only=False),
                                            env=env_for(threads, system))
                        rec.update(summarize(read_metrics(metrics), args.warmup,
                                             baselines[(cfg, system, ranks, threads)]))
                    recs[system] = rec
                    runs.append(rec)
                    print(f"compare: {cfg} {system} world {w} repeat {repeat}: "
                          f"{rec['step_time_s'] * 1e3:.1f} ms/step, peak RSS {rec['peak_rss_bytes'] / 2**20:.0f} MiB "
                          f"({rec['peak_rss_above_baseline_bytes'] / 2**20:.0f} above baseline)", flush=True)
                bad = loss_mismatches(cfg, w, repeat, recs)
                if bad:
                    print("\n".join(bad), file=sys.stderr)
                    raise SystemExit(f"compare: the systems do not do the same work (first {LOSS_STEPS} losses "
                                     f"differ by more than {LOSS_TOL:g}); no results written")

    # Across repeats: the median of the runs' medians, min..max as the spread.
    table = []
    for cfg in configs:
        seq = int(_arg(prep[cfg]["args"], "data.seq_len"))
        batch = int(_arg(prep[cfg]["args"], "data.batch_size_per_rank"))
        for w in worlds:
            for system in SYSTEMS:
                rs = [r for r in runs if r["config"] == cfg and r["world"] == w and r["system"] == system]
                if not rs:
                    continue
                st = [r["step_time_s"] for r in rs]
                row = {
                    "config": cfg, "system": system, "world": w, "ranks": rs[0]["ranks"],
                    "threads_per_rank": rs[0]["threads_per_rank"], "oversubscribed": rs[0]["oversubscribed"],
                    "repeats": len(rs),
                    "step_time_s": statistics.median(st), "step_time_min_s": min(st), "step_time_max_s": max(st),
                    "comm_wait_s": statistics.median([r["comm_wait_s"] for r in rs]),
                    "bytes_per_rank": statistics.median([r["bytes_per_rank"] for r in rs]),
                    "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                    "baseline_rss_bytes": rs[0]["baseline_rss_bytes"],
                    "peak_rss_above_baseline_bytes": max(r["peak_rss_above_baseline_bytes"] for r in rs),
                    "losses": rs[0]["losses"],
                    "phase_s": {k: statistics.median([r["phase_s"][k] for r in rs]) for k in rs[0]["phase_s"]},
                }
                row["tokens_per_s"] = seq * batch * row["ranks"] / row["step_time_s"]
                table.append(row)

    find = lambda c, s, w: next((r for r in table if r["config"] == c and r["system"] == s and r["world"] == w), None)
    # Scaling efficiency: one unsharded rank with N's threads on the same per-rank batch / N ranks.
    efficiency = {}
    for cfg in configs:
        efficiency[cfg] = {}
        for w in worlds:
            lt = find(cfg, "libtorch", w)
            if not lt:
                continue
            e = {"threads_per_rank": lt["threads_per_rank"], "unsharded_step_time_s": lt["step_time_s"],
                 "oversubscribed": w * lt["threads_per_rank"] > cores}
            for system in ("fsdp", "fsdp_gloo", "fsdp2"):
                r = find(cfg, system, w)
                if r:
                    r["scaling_efficiency"] = lt["step_time_s"] / r["step_time_s"]
                    e[system] = r["scaling_efficiency"]
            efficiency[cfg][str(w)] = e

    ratios = {}
    for cfg in configs:
        for w in worlds:
            a, f2 = find(cfg, "fsdp", w), find(cfg, "fsdp2", w)
            if a and f2:
                ratios[f"{cfg}/w{w}/step_time_fsdp_over_fsdp2"] = a["step_time_s"] / f2["step_time_s"]
                ratios[f"{cfg}/w{w}/peak_rss_fsdp_over_fsdp2"] = a["peak_rss_bytes"] / f2["peak_rss_bytes"]
                ratios[f"{cfg}/w{w}/peak_rss_above_baseline_fsdp_over_fsdp2"] = \
                    a["peak_rss_above_baseline_bytes"] / f2["peak_rss_above_baseline_bytes"]
            g = find(cfg, "fsdp_gloo", w)
            if g and f2:
                ratios[f"{cfg}/w{w}/step_time_fsdp_gloo_over_fsdp2"] = g["step_time_s"] / f2["step_time_s"]
            if a and g:
                ratios[f"{cfg}/w{w}/step_time_fsdp_over_fsdp_gloo"] = a["step_time_s"] / g["step_time_s"]
            if a and "scaling_efficiency" in a:
                ratios[f"{cfg}/w{w}/scaling_efficiency_fsdp"] = a["scaling_efficiency"]
            if g and "scaling_efficiency" in g:
                ratios[f"{cfg}/w{w}/scaling_efficiency_fsdp_gloo"] = g["scaling_efficiency"]
        # The first steps' losses of every system against fsdp's, at each world size (all checked
        # above to be within LOSS_TOL).
        for w in worlds:
            a = find(cfg, "fsdp", w)
            if not a:
                continue
            others = ["fsdp_gloo", "fsdp2"] + (["libtorch"] if w == 1 else [])
            diffs = [abs(x - y) for s in others if find(cfg, s, w) for x, y in zip(find(cfg, s, w)["losses"], a["losses"])]
            if diffs:
                ratios[f"{cfg}/w{w}/max_abs_loss_diff_first_steps"] = max(diffs)

    memcpy_bps = statistics.median([memcpy_bandwidth(args.python) for _ in range(3)])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"cores": cores, "memcpy_bytes_per_s_one_core": memcpy_bps, "transports": TRANSPORTS, "warmup_steps": args.warmup, "steps": steps, "repeats": args.repeats,
                   "loss_check": {"steps": LOSS_STEPS, "abs_tol": LOSS_TOL}, "table": table,
                   "scaling_efficiency": efficiency, "ratios": ratios, "runs": runs}, f, indent=2)
    md = markdown(table, efficiency, ratios, configs, worlds, cores, args) + breakdown(table, configs, memcpy_bps)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(md)
    plot(table, configs, worlds, cores, os.path.join(args.out, "compare.png"))
    print(md)
    for cfg in configs:
        print(f"compare: {cfg}: scaling efficiency of fsdp (unsharded 1 rank / N ranks, same per-rank batch and "
              "threads): " + ", ".join(f"N={w} {e['fsdp']:.3f}" for w, e in efficiency[cfg].items() if "fsdp" in e))


def _arg(args, key):
    for i, a in enumerate(args):
        if a == "--set" and args[i + 1].startswith(key + "="):
            return args[i + 1].split("=", 1)[1]
    raise KeyError(key)


def markdown(table, efficiency, ratios, configs, worlds, cores, args):
    mib = lambda x: f"{x / 2**20:.0f} MiB"
    out = [
        f"fsdp vs PyTorch FSDP2 vs unsharded LibTorch on this machine ({cores} cores), fp32, on the CPU. "
        "Transports: " + "; ".join(f"{NAMES[s]}: {TRANSPORTS[s]}" for s in SYSTEMS) + ". "
        "The two fsdp rows differ only in the transport, so fsdp (Gloo) against FSDP2 is the runtimes "
        "compared on one transport, and fsdp (shared memory) against fsdp (Gloo) is the transport's share. "
        "The same model, initial weights, batches, AdamW (fused in all three; weight decay on >= 2-D "
        "parameters only), LR schedule, clipping and attention kind (fsdp-train's model.attn_implementation).",
        f"Median step time after {args.warmup} warm-up steps: median over {args.repeats} interleaved repeats "
        "(spread = min..max of the repeats' medians). Threads per rank = cores / ranks (at least 1); "
        "more ranks than cores are oversubscribed. Every system runs with "
        f"GLIBC_TUNABLES={MALLOC_TUNABLES}: the malloc thresholds fsdp sets for itself at init.",
        "Unsharded LibTorch runs 1 rank with the threads of each N (one run serves every N with the same "
        "threads): the floor for scaling efficiency = its step time / the N-rank step time (1.0: "
        "communication and sharding cost nothing).",
        "Peak RSS / rank: the process peak (largest rank); above baseline: each rank's peak minus the same "
        "program's peak when run with --init-only (libraries imported, process group made, no model).",
        "Bytes sent per rank per step: fsdp from its counters; FSDP2 from a wrapper on its collective calls "
        "(ring bytes (N-1)/N of each gathered / reduced buffer). Blocked = time in communication waits "
        "(slowest rank), each interval counted once. "
        f"Losses: the first 3 steps; the first {LOSS_STEPS} of every system agree with fsdp's within "
        f"{LOSS_TOL:g} at each world size (checked; LibTorch at 1 rank).",
        "",
    ]
    for cfg in configs:
        out += [f"### {CONFIGS[cfg]['title']}", "",
                "| ranks | system | threads / rank | step time | spread | tokens/s | scaling efficiency | "
                "peak RSS / rank | above baseline | sent / rank / step | blocked / step | first losses |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in table:
            if r["config"] != cfg:
                continue
            if r["system"] == "libtorch":
                w = "1" if r["world"] == 1 else f"1 (for N={r['world']})"
            else:
                w = f"{r['world']}"
            if r["oversubscribed"]:
                w += " (oversubscribed)"
            eff = f"{r['scaling_efficiency']:.3f}" if "scaling_efficiency" in r else "-"
            out.append(
                f"| {w} | {NAMES[r['system']]} | {r['threads_per_rank']} | {r['step_time_s'] * 1e3:.1f} ms | "
                f"{r['step_time_min_s'] * 1e3:.1f}..{r['step_time_max_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                f"{eff} | {mib(r['peak_rss_bytes'])} | {mib(r['peak_rss_above_baseline_bytes'])} | "
                f"{r['bytes_per_rank'] / 2**20:.2f} MiB | {r['comm_wait_s'] * 1e3:.1f} ms | "
                f"{', '.join(f'{x:.4f}' for x in r['losses'][:3])} |")
        out.append("")
    out += ["### Scaling efficiency", "",
            "One unsharded LibTorch rank on the same per-rank batch with the same threads, divided by the step "
            "time on N ranks.", "",
            "| config | N | threads / rank | unsharded 1 rank | fsdp (shared memory) | fsdp (Gloo) | FSDP2 |",
            "|---|---|---|---|---|---|---|"]
    for cfg in configs:
        for w, e in efficiency[cfg].items():
            n = w + (" (oversubscribed)" if e["oversubscribed"] else "")
            cell = lambda s: f"{e[s]:.3f}" if s in e else "-"
            out.append(f"| {cfg} | {n} | {e['threads_per_rank']} | {e['unsharded_step_time_s'] * 1e3:.1f} ms | "
                       f"{cell('fsdp')} | {cell('fsdp_gloo')} | {cell('fsdp2')} |")
    out += ["", "### Ratios", "", "| ratio | value |", "|---|---|"]
    out += [f"| {k} | {v:.3g} |" for k, v in ratios.items()]
    return "\n".join(out) + "\n"


PARTS = ["forward", "backward", "check_finite", "clip", "optimizer"]


def breakdown(table, configs, memcpy_bps):
    """Where each system's step goes, against the unsharded step with the same threads and against the
    copy floor: the bytes each rank sends, copied once into the channel and once out of it, at one
    core's memcpy bandwidth (measured in the same run)."""
    out = ["", "### Where the step goes", "",
           f"Rank 0's milliseconds per part of the step (fsdp-train's and bench_unsharded's metrics phase_s; "
           "median over steps, then repeats). Forward and backward include the collectives and the time blocked "
           "in them; other = the rest of the step (fsdp: the metrics' own gather of every rank's counters). "
           f"Copy floor = 2 x bytes sent per rank / one core's memcpy bandwidth ({memcpy_bps / 1e9:.2f} GB/s, "
           "measured in this run: 64 MiB buffers, one thread).", "",
           "| config | ranks | system | step | " + " | ".join(PARTS) + " | other | blocked | copy floor |",
           "|---" * (len(PARTS) + 7) + "|"]
    for cfg in configs:
        for r in table:
            if r["config"] != cfg or not r.get("phase_s") or r["system"] not in ("fsdp", "fsdp_gloo", "libtorch"):
                continue
            ph = r["phase_s"]
            other = r["step_time_s"] - sum(ph.values())
            floor = 2 * r["bytes_per_rank"] / memcpy_bps
            who = NAMES[r["system"]] + (f" (threads of N={r['world']})" if r["system"] == "libtorch" else "")
            out.append(f"| {cfg} | {1 if r['system'] == 'libtorch' else r['world']} | {who} | "
                       f"{r['step_time_s'] * 1e3:.1f} | " + " | ".join(f"{ph.get(p, 0) * 1e3:.1f}" for p in PARTS) +
                       f" | {other * 1e3:.1f} | {r['comm_wait_s'] * 1e3:.1f} | {floor * 1e3:.1f} |")
    return "\n".join(out) + "\n"


def plot(table, configs, worlds, cores, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, len(configs), figsize=(6 * len(configs), 11), squeeze=False)
    for j, cfg in enumerate(configs):
        for system, marker in (("fsdp", "o"), ("fsdp_gloo", "D"), ("fsdp2", "s"), ("libtorch", "^")):
            rows = sorted((r for r in table if r["config"] == cfg and r["system"] == system), key=lambda r: r["world"])
            if not rows:
                continue
            ws = [r["world"] for r in rows]
            label = system if system != "libtorch" else "libtorch (1 rank, threads of N)"
            axes[0][j].errorbar(ws, [r["step_time_s"] * 1e3 for r in rows],
                                yerr=[[(r["step_time_s"] - r["step_time_min_s"]) * 1e3 for r in rows],
                                      [(r["step_time_max_s"] - r["step_time_s"]) * 1e3 for r in rows]],
                                marker=marker, label=label, capsize=3)
            line, = axes[1][j].plot(ws, [r["peak_rss_above_baseline_bytes"] / 2**20 for r in rows], marker=marker,
                                    label=f"{system} above baseline")
            axes[1][j].plot(ws, [r["peak_rss_bytes"] / 2**20 for r in rows], marker=marker, linestyle=":",
                            color=line.get_color(), label=f"{system} process peak")
            if system != "libtorch":
                axes[2][j].plot(ws, [r.get("scaling_efficiency", float("nan")) for r in rows], marker=marker,
                                label=system)
        axes[0][j].set_title(CONFIGS[cfg]["title"], fontsize=9)
        axes[0][j].set_ylabel("median step time (ms)")
        axes[1][j].set_ylabel("peak RSS per rank (MiB)")
        axes[2][j].set_ylabel("scaling efficiency (unsharded 1 rank / N ranks)")
        axes[2][j].axhline(1.0, color="grey", linewidth=0.8)
        for ax in (axes[0][j], axes[1][j], axes[2][j]):
            ax.set_xlabel(f"ranks (more than {cores} = oversubscribed)")
            ax.set_xticks(worlds)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
