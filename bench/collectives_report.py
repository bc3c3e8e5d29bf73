"""Merges bench_collectives outputs into one JSON list and a markdown table (fsdp vs Gloo)."""
import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()
    records = []
    for path in args.inputs:
        with open(path) as f:
            records += json.load(f)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=2)
        f.write("\n")

    def find(op, impl, n, size):
        for r in records:
            if (r["op"], r["impl"], r["world_size"], r["bytes_per_rank_buffer"]) == (op, impl, n, size):
                return r
        return None

    cores = os.cpu_count()
    lines = [
        "Median time per collective; bytes_sent is per rank (fsdp: counted; Gloo: its algorithm).",
        f"Machine: {cores} cores; world size 4 is oversubscribed when cores < 4.",
        "",
        "| op | N | buffer | fsdp time | Gloo time | fsdp/Gloo time | fsdp sent | Gloo sent | fsdp busbw GB/s | Gloo busbw GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["op"], r["world_size"], r["bytes_per_rank_buffer"]) for r in records})
    for op, n, size in keys:
        ours, gloo = find(op, "fsdp", n, size), find(op, "gloo", n, size)
        if not ours or not gloo:
            continue
        lines.append(
            f"| {op} | {n} | {size / 2**20:.3g} MiB | {ours['time_s'] * 1e3:.2f} ms | {gloo['time_s'] * 1e3:.2f} ms"
            f" | {ours['time_s'] / gloo['time_s']:.2f} | {ours['bytes_sent_per_rank'] / 2**20:.3g} MiB"
            f" | {gloo['bytes_sent_per_rank'] / 2**20:.3g} MiB | {ours['busbw'] / 1e9:.2f} | {gloo['busbw'] / 1e9:.2f} |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
