"""Table of a bench_checkpoint run against dd on the same number of bytes.

Reads rank 0's JSON object from bench_checkpoint and dd's stderr of each write
(`conv=fdatasync`) and read run, computes throughput from the byte counts and seconds dd
prints (not its rounded rates), keeps the best run of each (as bench_checkpoint does), and
writes the combined JSON and a markdown table.
"""
import argparse
import json
import re

DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s,")


def parse_dd(path):
    """Bytes and seconds from dd's summary line."""
    with open(path) as f:
        for line in f:
            m = DD_LINE.match(line.strip())
            if m:
                nbytes, seconds = int(m.group(1)), float(m.group(2))
                return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}
    raise SystemExit(f"checkpoint_report: no dd summary line in {path}")


def best_dd(paths):
    runs = [parse_dd(p) for p in paths]
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["runs"] = [r["seconds"] for r in runs]
    return best


def runs_text(seconds):
    return ", ".join(f"{s:.2f}" for s in seconds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json")
    ap.add_argument("--dd-write", nargs="+", required=True)
    ap.add_argument("--dd-read", nargs="+", required=True)
    ap.add_argument("--dd-read-cache", choices=["cold", "warm"], required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()

    with open(args.bench_json) as f:
        lines = [line for line in f if line.strip()]
    if len(lines) != 1:
        raise SystemExit(f"checkpoint_report: expected one JSON line in {args.bench_json}, found {len(lines)}")
    run = json.loads(lines[0])
    run["dd"] = {"write": best_dd(args.dd_write), "read": best_dd(args.dd_read)}
    run["dd"]["read"]["cache"] = args.dd_read_cache
    run["ratio_save_vs_dd_write"] = run["save"]["gb_per_s"] / run["dd"]["write"]["gb_per_s"]
    run["ratio_load_vs_dd_read"] = run["load"]["gb_per_s"] / run["dd"]["read"]["gb_per_s"]
    with open(args.json, "w") as f:
        json.dump(run, f, indent=2)
        f.write("\n")

    gib = lambda b: b / 2**30
    save, load, dd, a = run["save"], run["load"], run["dd"], run["async"]
    load_cache = "cold" if load["cache"].startswith("cold") else "warm"
    lines = [
        f"Sharded checkpoint, {run['world_size']} ranks (fsdp-run), {run['layers']} x [{run['dim']}, {run['dim']}]"
        f" fp32 params ({gib(run['param_bytes']):.2f} GiB) + AdamW exp_avg + exp_avg_sq;"
        f" data checked: {'yes, bit-exact' if load['data_checked'] else 'MISMATCH'}.",
        "",
        "Best of each phase's runs (every run's seconds in brackets); the disk and the 2 cores are shared, so"
        " single runs vary widely, and the first save and load of the process run on fresh files and memory."
        f" Creating the checkpoint communicator (once per process) took {run['side_group_setup_seconds']:.3f} s"
        " and is not in the save times.",
        "",
        "| phase | bytes | fsdp time | fsdp GB/s | dd time | dd GB/s | fsdp / dd |",
        "|---|---|---|---|---|---|---|",
        f"| save (fsync) | {gib(save['bytes']):.2f} GiB | {save['seconds']:.3f} s [{runs_text(save['runs'])}]"
        f" | {save['gb_per_s']:.2f} | {dd['write']['seconds']:.3f} s [{runs_text(dd['write']['runs'])}]"
        f" | {dd['write']['gb_per_s']:.2f} | {run['ratio_save_vs_dd_write']:.2f} |",
        f"| load ({load_cache} cache; dd read: {dd['read']['cache']}) | {gib(load['bytes']):.2f} GiB"
        f" | {load['seconds']:.3f} s [{runs_text(load['runs'])}] | {load['gb_per_s']:.2f}"
        f" | {dd['read']['seconds']:.3f} s [{runs_text(dd['read']['runs'])}] | {dd['read']['gb_per_s']:.2f}"
        f" | {run['ratio_load_vs_dd_read']:.2f} |",
        "",
        "Background save (AsyncSaver), rank 0:",
        "",
        "| plain step (median of 5) | step + AsyncSaver::save | stall | save() call (snapshot) | save finished after call |",
        "|---|---|---|---|---|",
        f"| {a['plain_step_seconds']:.3f} s | {a['step_with_save_seconds']:.3f} s | {a['stall_seconds']:+.3f} s"
        f" | {a['save_call_seconds']:.3f} s | {a['background_done_seconds']:.3f} s |",
        "",
        f"Plain steps: {', '.join(f'{s:.3f}' for s in a['plain_steps'])} s (shared 2-core machine: a stall smaller"
        " than their spread is noise; the save() call time is the snapshot's cost).",
    ]
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
