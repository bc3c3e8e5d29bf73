"""Merges bench_collectives outputs into one JSON list and a markdown table (fsdp over shared memory,
fsdp over Gloo point-to-point, ProcessGroupGloo)."""
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
        "Median time per collective (fp32 buffer of the size shown, the full unsharded buffer); busbw as in",
        "nccl-tests (all-reduce counts both phases). fsdp shm: fsdp's rings over shared memory between the",
        "ranks of this host (the default); fsdp ring: the same rings over Gloo point-to-point (what ranks on",
        "different hosts use); Gloo: ProcessGroupGloo's own collectives. Bytes sent per rank: fsdp counted,",
        "Gloo from its algorithm (its reduce-scatter is an all-reduce).",
        f"Machine: {cores} cores; world size 4 is oversubscribed when cores < 4.",
        "",
        "| op | N | buffer | fsdp shm | fsdp ring (Gloo) | Gloo | shm/ring | shm/Gloo | shm busbw GB/s | ring busbw GB/s | Gloo busbw GB/s | sent shm / Gloo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["op"], r["world_size"], r["bytes_per_rank_buffer"]) for r in records})
    for op, n, size in keys:
        shm, ring, gloo = (find(op, impl, n, size) for impl in ("shm", "ring", "gloo"))
        if not shm or not ring or not gloo:
            continue
        ms = lambda r: f"{r['time_s'] * 1e3:.2f} ms"
        lines.append(
            f"| {op} | {n} | {size / 2**20:.3g} MiB | {ms(shm)} | {ms(ring)} | {ms(gloo)}"
            f" | {shm['time_s'] / ring['time_s']:.2f} | {shm['time_s'] / gloo['time_s']:.2f}"
            f" | {shm['busbw'] / 1e9:.2f} | {ring['busbw'] / 1e9:.2f} | {gloo['busbw'] / 1e9:.2f}"
            f" | {shm['bytes_sent_per_rank'] / 2**20:.3g} / {gloo['bytes_sent_per_rank'] / 2**20:.3g} MiB |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
