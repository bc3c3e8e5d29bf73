"""fsdp on one rank against unsharded LibTorch: the runtime's fixed cost per step.

With one rank nothing is sent, so what fsdp's step costs beyond bench_unsharded (plain LibTorch
with fsdp's own fused AdamW and clipping kernels on the unsharded parameters, the same model,
data, optimizer groups, schedule and clipping) is the runtime's own overhead: hooks, flat-buffer
views and copies, the reduce path, the optimizer's bookkeeping.

For each config (the communication-bound and compute-bound models of scripts/bench compare) and
each thread count, it runs fsdp-train on one rank and bench_unsharded alternately, REPEATS times,
and reports each one's median step time after the warm-up steps (median over steps, then over
repeats) and fsdp / LibTorch. --baseline BIN adds a third system: fsdp-train from another build
(e.g. before a change), in the same interleaving. The first losses must agree within 1e-4 (the
same work); otherwise it exits with status 1.

    .venv/bin/python bench/one_rank.py [--build build/bin] [--baseline OLD/bin] [--threads 1,2]
        [--configs comm,compute] [--repeats 3] [--json OUT.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ab_step_time import CONFIGS, MALLOC_TUNABLES  # scripts/bench compare's configs; malloc thresholds

STEPS = {"comm": 40, "compute": 8}
WARMUP = 2
LOSS_STEPS, LOSS_TOL = 5, 1e-4


def run(cmd, threads, metrics):
    # The malloc thresholds fsdp sets for itself at init, for both (bench_unsharded makes no process group).
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), FSDP_THREADS=str(threads), GLIBC_TUNABLES=MALLOC_TUNABLES)
    env.pop("FSDP_CPU_TRANSPORT", None)
    p = subprocess.run(cmd + ["--metrics", metrics], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=1800)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:])
        raise SystemExit(f"one_rank: failed (exit {p.returncode}): {' '.join(cmd)}")
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    rows = [r for r in rows if "step_time_s" in r and not r.get("eval")]
    return (statistics.median(r["step_time_s"] for r in rows[WARMUP:]), [r["loss"] for r in rows[:LOSS_STEPS]],
            phases_of(rows[WARMUP:]))


PHASES = ["data", "forward", "backward", "check_finite", "clip", "optimizer", "other"]


def phases_of(rows):
    """Median seconds per phase over the steps (phase_s of the metrics lines); "other" is the rest of
    step_time_s (fsdp-train: the metrics' own gather; LibTorch: loss.item())."""
    out = {}
    for name in PHASES:
        vals = []
        for r in rows:
            ph = r.get("phase_s", {})
            vals.append(r["step_time_s"] - sum(ph.values()) if name == "other" else ph.get(name, 0.0))
        out[name] = statistics.median(vals)
    return out


def breakdown(cfg, threads, phases):
    """A markdown table: each phase's median over repeats for every system, and fsdp minus LibTorch."""
    med = {s: {p: statistics.median(rep[p] for rep in reps) for p in PHASES} for s, reps in phases.items()}
    lines = [f"{cfg}, {threads} thread(s): median ms per phase", "",
             "| phase | " + " | ".join(med) + " | fsdp - libtorch |", "|---" * (len(med) + 2) + "|"]
    for p in PHASES:
        lines.append(f"| {p} | " + " | ".join(f"{med[s][p] * 1e3:.2f}" for s in med) +
                     f" | {(med['fsdp'][p] - med['libtorch'][p]) * 1e3:+.2f} |")
    return "\n".join(lines), med


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build/bin")
    ap.add_argument("--baseline", help="bin folder of another build's fsdp-train, run alongside")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--configs", default="comm,compute")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    systems = {"fsdp": f"{args.build}/fsdp-train", "libtorch": f"{args.build}/bench_unsharded"}
    if args.baseline:
        systems["fsdp (baseline build)"] = f"{args.baseline}/fsdp-train"
    tmp = tempfile.mkdtemp(prefix="fsdp-one-rank-")
    results = []
    for cfg in args.configs.split(","):
        common = ["--steps", str(STEPS[cfg]), "--set", "train.eval_every=0", "--set", "optim.warmup_steps=2",
                  "--set", "train.log_every=1000"]
        for kv in CONFIGS[cfg]:
            common += ["--set", kv]
        for threads in [int(t) for t in args.threads.split(",")]:
            times = {s: [] for s in systems}
            phases = {s: [] for s in systems}
            losses = {}
            for rep in range(args.repeats):
                for name, exe in systems.items():
                    t, l, ph = run([exe] + common, threads, os.path.join(tmp, f"{cfg}-{threads}-{rep}-{len(times[name])}"
                                                                    f"-{name.split()[0]}{len(name)}.jsonl"))
                    times[name].append(t)
                    phases[name].append(ph)
                    losses.setdefault(name, l)
            for name, l in losses.items():
                for i, (a, b) in enumerate(zip(l, losses["fsdp"])):
                    if not abs(a - b) <= LOSS_TOL:
                        raise SystemExit(f"one_rank: {cfg}, {threads} thread(s): {name} step {i + 1} loss {a:.6f} vs "
                                         f"fsdp {b:.6f}: not the same work; no results")
            row = {"config": cfg, "threads": threads,
                   "median_step_s": {s: statistics.median(v) for s, v in times.items()},
                   "repeats_s": times}
            row["fsdp_over_libtorch"] = row["median_step_s"]["fsdp"] / row["median_step_s"]["libtorch"]
            if args.baseline:
                row["baseline_over_libtorch"] = row["median_step_s"]["fsdp (baseline build)"] / \
                    row["median_step_s"]["libtorch"]
            table, row["median_phase_s"] = breakdown(cfg, threads, phases)
            results.append(row)
            med = row["median_step_s"]
            line = (f"{cfg:8s} threads {threads}: fsdp {med['fsdp'] * 1e3:8.2f} ms  libtorch "
                    f"{med['libtorch'] * 1e3:8.2f} ms  fsdp/libtorch {row['fsdp_over_libtorch']:.3f}")
            if args.baseline:
                line += (f"  baseline {med['fsdp (baseline build)'] * 1e3:8.2f} ms  baseline/libtorch "
                         f"{row['baseline_over_libtorch']:.3f}")
            print(line + "  repeats " + "; ".join(f"{s}: " + ", ".join(f"{x * 1e3:.2f}" for x in v)
                                                  for s, v in times.items()), flush=True)
            print(table + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
