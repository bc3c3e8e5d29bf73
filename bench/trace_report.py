"""Where a step's blocked communication time goes, from fsdp-train --trace files.

  python bench/trace_report.py TRACE.rank0.json [--skip 2] [--timeline STEP]

For every step after the first --skip: the time the training thread spent in each kind of wait
(fsdp::all_gather_wait, fsdp::reduce_scatter_wait, fsdp::all_reduce_wait), split by the trainer
phase it fell in (train::forward, train::backward, train::clip_grad_norm, train::optimizer) and by
unit; the communicator's busy time (its all-gathers and reduce-scatters, issue to completion); and
how much of that busy time ran under compute (not under a wait). --timeline prints one step's
spans in time order, which is what the closing note of the prefetch work describes.
"""
import argparse
import collections
import json
import statistics

WAITS = ("fsdp::all_gather_wait", "fsdp::reduce_scatter_wait", "fsdp::all_reduce_wait")
PHASES = ("train::data", "train::forward", "train::backward", "train::clip_grad_norm", "train::optimizer",
          "train::metrics")


def load(path):
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    return events


def steps_of(events):
    """[(start, end)] per training step: train::data's start to train::metrics' end (fsdp-train),
    else each train::step span (bench_disk_tier)."""
    starts = [e["ts"] for e in events if e["name"] == "train::data"]
    ends = [e["ts"] + e["dur"] for e in events if e["name"] == "train::metrics"]
    if not starts:
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "train::step"]
    return list(zip(starts, ends))


def within(e, lo, hi):
    return e["ts"] >= lo and e["ts"] < hi


def union_length(intervals):
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


def overlap(intervals, holes):
    """Length of union(intervals) minus its intersection with union(holes)."""
    inside = []
    for lo, hi in intervals:
        for hlo, hhi in holes:
            a, b = max(lo, hlo), min(hi, hhi)
            if a < b:
                inside.append((a, b))
    return union_length(intervals) - union_length(inside)


def analyse(events, skip):
    per_step = []
    for lo, hi in steps_of(events)[skip:]:
        evs = [e for e in events if within(e, lo, hi)]
        phases = [e for e in evs if e["name"] in PHASES]
        waits = collections.Counter()
        by_unit = collections.Counter()
        for e in evs:
            if e["name"] not in WAITS:
                continue
            phase = next((p["name"] for p in phases if p["ts"] <= e["ts"] < p["ts"] + p["dur"]), "other")
            waits[(e["name"], phase)] += e["dur"]
            by_unit[(e["name"], e.get("args", {}).get("unit", ""), phase)] += e["dur"]
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in evs if e["name"] in ("fsdp::all_gather", "fsdp::reduce_scatter")]
        wait_iv = [(e["ts"], e["ts"] + e["dur"]) for e in evs if e["name"] in WAITS]
        # The disk tier's I/O threads (their own lanes) and the time the training thread waited
        # for a read: the I/O under neither a disk wait nor a communication wait overlapped compute.
        span = lambda name: [(e["ts"], e["ts"] + e["dur"]) for e in evs if e["name"] == name]
        disk_wait = span("fsdp::disk_read_wait")
        per_step.append({
            "disk_read_ms": union_length(span("fsdp::disk_read")) / 1e3,
            "disk_write_ms": union_length(span("fsdp::disk_write")) / 1e3,
            "disk_wait_ms": union_length(disk_wait) / 1e3,
            "disk_io_under_compute_ms": overlap(span("fsdp::disk_read") + span("fsdp::disk_write"),
                                                disk_wait + wait_iv) / 1e3,
            "optimizer_ms": union_length(span("fsdp::optimizer_step")) / 1e3,
            "step_ms": (hi - lo) / 1e3,
            "waits": waits,
            "by_unit": by_unit,
            "comm_busy_ms": union_length(comm) / 1e3,
            "comm_under_compute_ms": overlap(comm, wait_iv) / 1e3,
            "blocked_ms": union_length(wait_iv) / 1e3,
        })
    return per_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--timeline", type=int, default=-1)
    args = ap.parse_args()
    events = load(args.trace)
    steps = analyse(events, args.skip)
    med = lambda k: statistics.median(s[k] for s in steps)
    print(f"{args.trace}: {len(steps)} steps after {args.skip} skipped (medians per step)")
    print(f"  step {med('step_ms'):.1f} ms; blocked in waits {med('blocked_ms'):.1f} ms; communicator busy "
          f"{med('comm_busy_ms'):.1f} ms, of which under compute (hidden) {med('comm_under_compute_ms'):.1f} ms")
    if med("disk_read_ms") + med("disk_write_ms") > 0:
        print(f"  disk tier: reading {med('disk_read_ms'):.1f} ms, writing {med('disk_write_ms'):.1f} ms (own lanes); "
              f"training thread waited for reads {med('disk_wait_ms'):.1f} ms; I/O under compute "
              f"{med('disk_io_under_compute_ms'):.1f} ms; optimizer step {med('optimizer_ms'):.1f} ms")
    keys = sorted({k for s in steps for k in s["waits"]})
    for k in keys:
        print(f"  {k[0]:<28} in {k[1]:<22} {statistics.median(s['waits'][k] for s in steps) / 1e3:8.1f} ms")
    units = collections.Counter()
    for s in steps:
        units.update(s["by_unit"])
    print("  largest waits by unit (mean per step):")
    for (name, unit, phase), us in units.most_common(8):
        print(f"    {name:<28} {unit:<22} {phase:<22} {us / len(steps) / 1e3:8.1f} ms")
    if args.timeline >= 0:
        lo, hi = steps_of(events)[args.timeline]
        print(f"step {args.timeline} timeline (ms from its start; thread 0 = trainer, 1 = communicator, 2 = fsdp hooks):")
        for e in events:
            if within(e, lo, hi):
                unit = e.get("args", {}).get("unit", "")
                print(f"  {(e['ts'] - lo) / 1e3:9.2f} +{e['dur'] / 1e3:8.2f}  t{e['tid']}  {e['name']:<26} {unit}")


if __name__ == "__main__":
    main()
