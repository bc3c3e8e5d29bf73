"""Prefetch off vs on from fsdp-train metrics: median step time and blocked communication time."""
import argparse
import glob
import json
import os
import statistics


def load(path, warmup=2):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    rows = [r for r in rows if not r.get("eval")][warmup:]
    return {
        "step_time_s": [r["step_time_s"] for r in rows],
        "comm_wait_s": [max(r["comm_wait_s"]) for r in rows],  # the slowest rank's blocked time
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()
    results = {}
    for path in sorted(glob.glob(os.path.join(args.dir, "*.jsonl"))):
        cfg, depth, _ = os.path.basename(path)[:-6].split("-")
        r = results.setdefault(cfg, {}).setdefault(depth, {"step_time_s": [], "comm_wait_s": []})
        m = load(path)
        r["step_time_s"] += m["step_time_s"]
        r["comm_wait_s"] += m["comm_wait_s"]
    out, lines = [], [
        "fsdp-train on 2 ranks (2 cores), fp32, FULL_SHARD; medians over steps after 2 warm-up steps, 2 interleaved repeats.",
        "comm wait = time the training thread was blocked in all-gather / reduce-scatter waits (slowest rank).",
        "",
        "| config | prefetch | step time | comm wait / step | wait on/off | hidden |",
        "|---|---|---|---|---|---|",
    ]
    names = {"comm": "communication-bound (h256, 4 layers, seq 64, batch 1)",
             "compute": "compute-bound (h512, 6 layers, seq 256, batch 4)"}
    for cfg in ("comm", "compute"):
        if cfg not in results:
            continue
        off, on = results[cfg].get("0"), results[cfg].get("1")
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        w_off, w_on = med(off["comm_wait_s"]), med(on["comm_wait_s"])
        for depth, r in (("off", off), ("on (depth 1)", on)):
            rec = {"config": cfg, "prefetch": depth, "median_step_time_s": med(r["step_time_s"]),
                   "step_time_spread_s": [min(r["step_time_s"]), max(r["step_time_s"])],
                   "median_comm_wait_s": med(r["comm_wait_s"])}
            out.append(rec)
        ratio = w_on / w_off if w_off > 0 else float("nan")
        lines.append(f"| {names[cfg]} | off | {med(off['step_time_s']) * 1e3:.1f} ms | {w_off * 1e3:.1f} ms | | |")
        lines.append(f"| {names[cfg]} | on | {med(on['step_time_s']) * 1e3:.1f} ms | {w_on * 1e3:.1f} ms | {ratio:.2f} | {1 - ratio:.0%} |")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
