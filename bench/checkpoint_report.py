"""Table of a bench_checkpoint run against dd on the same number of bytes.

Reads rank 0's JSON object from bench_checkpoint and dd's stderr for the write
(`conv=fdatasync`) and the read, computes throughput from the byte counts and seconds dd
prints (not its rounded rates), and writes the combined JSON and a markdown table.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json")
    ap.add_argument("--dd-write", required=True)
    ap.add_argument("--dd-read", required=True)
    ap.add_argument("--dd-read-cache", choices=["cold", "warm"], required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()

    with open(args.bench_json) as f:
        lines = [line for line in f if line.strip()]
    if len(lines) != 1:
        raise SystemExit(f"checkpoint_report: expected one JSON line in {args.bench_json}, found {len(lines)}")
    run = json.loads(lines[0])
    run["dd"] = {"write": parse_dd(args.dd_write), "read": parse_dd(args.dd_read)}
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
        "| phase | bytes | fsdp time | fsdp GB/s | dd time | dd GB/s | fsdp / dd |",
        "|---|---|---|---|---|---|---|",
        f"| save (fsync) | {gib(save['bytes']):.2f} GiB | {save['seconds']:.3f} s | {save['gb_per_s']:.2f}"
        f" | {dd['write']['seconds']:.3f} s | {dd['write']['gb_per_s']:.2f} | {run['ratio_save_vs_dd_write']:.2f} |",
        f"| load ({load_cache} cache; dd read: {dd['read']['cache']}) | {gib(load['bytes']):.2f} GiB"
        f" | {load['seconds']:.3f} s | {load['gb_per_s']:.2f}"
        f" | {dd['read']['seconds']:.3f} s | {dd['read']['gb_per_s']:.2f} | {run['ratio_load_vs_dd_read']:.2f} |",
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
