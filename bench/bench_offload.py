#!/usr/bin/env python3
"""The offload demonstration: the largest fsdp-train model that trains 3 steps on this machine in
three modes, by doubling the number of decoder layers (hidden 512, intermediate 1536, 8 heads,
vocab 256, seq 64, batch 1 per rank, fp32) until a run fails or a rank's anonymous RSS exceeds the
cap:
  (a) unsharded, 1 rank (NO_SHARD);  (b) FULL_SHARD, 2 ranks;
  (c) FULL_SHARD, 2 ranks, master params and AdamW state in the disk tier (fsdp.offload).
Peak anonymous RSS (RssAnon in /proc/PID/status: heap and anonymous mappings, not file pages such
as libtorch's code or the disk tier's page cache) is sampled every 10 ms per rank process; a run
is stopped as soon as one rank passes the cap. Step time is the median of the 3 steps' step_time_s.
Writes bench/results/offload.{json,md}.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def rss_anon(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rank_pids(launcher_pid):
    """fsdp-train processes under the launcher (children of fsdp-run)."""
    out = []
    try:
        kids = open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()
    except OSError:
        return out
    for k in kids:
        try:
            if b"fsdp-train" in open(f"/proc/{k}/cmdline", "rb").read():
                out.append(int(k))
        except OSError:
            pass
    return out


def run(args, mode, layers, tmp):
    nproc = 1 if mode == "a" else 2
    metrics = os.path.join(tmp, f"{mode}-{layers}.jsonl")
    cmd = [args.bin + "/fsdp-run", "--nproc-per-node", str(nproc), "--timeout-s", str(args.timeout_s), "--",
           args.bin + "/fsdp-train", "--steps", "3", "--metrics", metrics,
           "--set", "model.hidden_size=512", "--set", "model.intermediate_size=1536",
           "--set", f"model.num_hidden_layers={layers}", "--set", "model.num_attention_heads=8",
           "--set", "model.num_key_value_heads=8", "--set", "model.vocab_size=256",
           "--set", "data.seq_len=64", "--set", "data.batch_size_per_rank=1",
           "--set", "train.eval_every=0", "--set", "optim.warmup_steps=1", "--set", "train.log_every=1",
           "--set", "fsdp.strategy=" + ("NO_SHARD" if mode == "a" else "FULL_SHARD")]
    if mode == "c":
        cmd += ["--set", "fsdp.offload.params=disk", "--set", "fsdp.offload.optimizer_state=disk",
                "--set", "fsdp.offload.dir=" + os.path.join(args.offload_dir, f"run-{layers}"),
                "--set", f"fsdp.offload.memory_budget_bytes={args.budget_mib << 20}"]
    # glibc raises its mmap threshold up to 32 MiB after the first large free, after which freed
    # flat buffers stay in the heap; a fixed 1 MiB threshold returns them (same for every mode).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold))
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    peaks = {}
    over_cap = False
    out_chunks = []
    os.set_blocking(proc.stdout.fileno(), False)
    while proc.poll() is None:
        for pid in rank_pids(proc.pid):
            r = rss_anon(pid)
            if r is not None:
                peaks[pid] = max(peaks.get(pid, 0), r)
        if peaks and max(peaks.values()) > args.cap_mib << 20:
            over_cap = True
            for pid in list(peaks) + [proc.pid]:  # the ranks run in their own process groups
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            break
        try:
            chunk = proc.stdout.read()
            if chunk:
                out_chunks.append(chunk)
        except (BlockingIOError, TypeError):
            pass
        time.sleep(0.01)
    proc.wait()
    rest = proc.stdout.read()
    if rest:
        out_chunks.append(rest)
    output = b"".join(out_chunks).decode(errors="replace")
    m = re.search(r"([0-9.]+)M params", output)
    params = int(round(float(m.group(1)) * 1e6)) if m else None
    steps = []
    if os.path.exists(metrics):
        for line in open(metrics):
            j = json.loads(line)
            if "step_time_s" in j:
                steps.append(j["step_time_s"])
    ok = proc.returncode == 0 and not over_cap and len(steps) == 3
    return {
        "mode": mode, "layers": layers, "ranks": nproc, "params": params, "ok": ok, "over_cap": over_cap,
        "returncode": proc.returncode, "peak_rss_anon_bytes_per_rank": sorted(peaks.values(), reverse=True),
        "step_time_s": statistics.median(steps) if steps else None, "wall_s": round(time.time() - start, 1),
        "tail": "" if ok else output[-600:],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="build/bin")
    p.add_argument("--cap-mib", type=int, default=1024, help="peak anonymous RSS per rank allowed")
    p.add_argument("--budget-mib", type=int, default=64, help="(c): fsdp.offload.memory_budget_bytes")
    p.add_argument("--max-layers", type=int, default=256)
    p.add_argument("--timeout-s", type=int, default=900)
    p.add_argument("--mmap-threshold", type=int, default=1 << 20, help="MALLOC_MMAP_THRESHOLD_ for the ranks")
    p.add_argument("--modes", default="abc")
    p.add_argument("--offload-dir", default=None)
    p.add_argument("--json", default="bench/results/offload.json")
    p.add_argument("--markdown", default="bench/results/offload.md")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fsdp-bench-offload-")
    args.offload_dir = args.offload_dir or os.path.join(tmp, "offload")
    runs, best = [], {}
    for mode in args.modes:
        layers = 1
        while layers <= args.max_layers:
            r = run(args, mode, layers, tmp)
            runs.append(r)
            print(f"bench offload: ({mode}) {layers} layers, {r['params']} params: "
                  f"{'ok' if r['ok'] else ('over the cap' if r['over_cap'] else 'FAILED rc %s' % r['returncode'])}, "
                  f"peak anon RSS/rank {[round(b / 2**20) for b in r['peak_rss_anon_bytes_per_rank']]} MiB, "
                  f"step {r['step_time_s']} s, wall {r['wall_s']} s", flush=True)
            if not r["ok"]:
                if not r["over_cap"]:
                    print(r["tail"], flush=True)
                break
            best[mode] = r
            layers *= 2
    meminfo = open("/proc/meminfo").read().split("\n")[0]
    result = {"cap_bytes_per_rank": args.cap_mib << 20, "budget_bytes": args.budget_mib << 20,
              "cores": os.cpu_count(), "meminfo": meminfo, "runs": runs,
              "largest": {m: best.get(m) for m in "abc"}}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    names = {"a": "(a) unsharded, 1 rank", "b": "(b) FULL_SHARD, 2 ranks",
             "c": "(c) FULL_SHARD + disk tier (params, AdamW state), 2 ranks"}
    lines = ["# Offload demonstration", "",
             f"Largest fsdp-train model that trains 3 steps with peak anonymous RSS at most {args.cap_mib} MiB per "
             f"rank ({os.cpu_count()} cores, {meminfo.split(':')[1].strip()} RAM; hidden 512, intermediate 1536, "
             f"layers doubled; seq 64, batch 1 per rank, fp32, AdamW; disk-tier budget {args.budget_mib} MiB). "
             "Measured by `scripts/bench offload` (bench/bench_offload.py).", "",
             "| mode | layers | params | peak anon RSS per rank (MiB) | median step time (s) | x (a) |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    a_params = best.get("a", {}).get("params") if best.get("a") else None
    for m in "abc":
        r = best.get(m)
        if r is None:
            lines.append(f"| {names[m]} | - | none fit | | | |")
            continue
        ratio = f"{r['params'] / a_params:.1f}" if a_params else "-"
        lines.append(f"| {names[m]} | {r['layers']} | {r['params'] / 1e6:.1f}M | "
                     f"{', '.join(str(round(b / 2**20)) for b in r['peak_rss_anon_bytes_per_rank'])} | "
                     f"{r['step_time_s']:.2f} | {ratio} |")
    lines += ["", "Next size up (the run that stopped the doubling):", "",
              "| mode | layers | params | outcome | peak anon RSS per rank (MiB) |", "| --- | ---: | ---: | --- | --- |"]
    for r in runs:
        if not r["ok"]:
            outcome = "over the cap (stopped)" if r["over_cap"] else f"failed (exit {r['returncode']})"
            lines.append(f"| {names[r['mode']]} | {r['layers']} | "
                         f"{(r['params'] or 0) / 1e6:.1f}M | {outcome} | "
                         f"{', '.join(str(round(b / 2**20)) for b in r['peak_rss_anon_bytes_per_rank'])} |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    subprocess.run(["rm", "-rf", tmp])
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
