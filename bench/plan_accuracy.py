#!/usr/bin/env python3
"""The plan against each phase's measured peak RSS, from bench/scale.py's JSON (--lora runs): one
table per model, every phase (import, the steps' whole process, each save's own peak, resume,
exports, the 2-layer check run), each rank's peak against the plan fsdp-train printed for it, no
item replaced:
  - import: the plan's load phase; a run with steps (train, resume, check-train): the plan's peak
    over its load, steps and a save (`peak per rank`);
  - a save: the plan's save phase, against the save's own peak (fsdp-train's `peak RSS per rank
    during the save`, its watermark reset after the step's freed memory was returned);
  - export-adapter: the plan's adapter export; export-merged: the plan's (converting) export.
A ratio outside 0.9-1.1 is marked "missed".

Usage: plan_accuracy.py RESULT.json... [--out FILE.md]
"""
import argparse
import json

MIB = 1 << 20
LOW, HIGH = 0.9, 1.1


def rows_of(r):
    phases = {p["phase"]: p for p in r["phases"]}
    export = {k: next((p[key] for p in r["phases"] if p.get(key)), None)
              for k, key in (("merged", "plan_export_bytes"), ("adapter", "plan_export_adapter_bytes"))}
    out = []
    for name in ("import", "train", "resume", "export-adapter", "export-merged", "check-train"):
        p = phases.get(name)
        if p is None or p.get("rc") != 0:
            out.append((name, None, None))
            continue
        rss = p.get("peak_rss_bytes") or [p.get("maxrss_bytes")]
        if name == "import":
            plan = p.get("plan_load_bytes")
        elif name.startswith("export"):
            plan = export["adapter" if name == "export-adapter" else "merged"]
        else:
            plan = p.get("plan_peak_bytes")
        label = {"import": "import (the load)", "train": "train (whole process)",
                 "resume": "resume (whole process)", "check-train": "check-train (whole process)"}.get(name, name)
        out.append((label, rss, plan))
        for s in p.get("save_metrics") or []:
            if s.get("peak_rss_bytes"):
                out.append((f"{name}: save of step {s['step']} (its own peak)", s["peak_rss_bytes"],
                            p.get("plan_save_bytes")))
    return out


def table(r):
    lines = [f"### {r['model']} ({r['params'] / 1e6:,.1f}M parameters), QLoRA", "",
             "| phase | peak RSS per rank (MiB) | plan (MiB) | RSS / plan | within 0.9-1.1 |",
             "| --- | --- | --- | --- | --- |"]
    met = missed = 0
    for label, rss, plan in rows_of(r):
        if rss is None:
            lines.append(f"| {label} | not run | - | - | - |")
            continue
        if not plan:
            lines.append(f"| {label} | {' / '.join(f'{x / MIB:,.0f}' for x in rss)} | no plan printed | - | - |")
            continue
        ratios = [x / plan for x in rss]
        ok = all(LOW <= x <= HIGH for x in ratios)
        met, missed = met + ok, missed + (not ok)
        lines.append(f"| {label} | {' / '.join(f'{x / MIB:,.0f}' for x in rss)} | {plan / MIB:,.1f} | "
                     f"{' / '.join(f'{x:.3f}' for x in ratios)} | {'met' if ok else 'missed'} |")
    return lines, met, missed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    out, total_missed = [], 0
    for path in args.results:
        r = json.load(open(path))
        lines, met, missed = table(r)
        total_missed += missed
        out += lines + ["", f"Commit {r.get('commit')}; {met} rows met, {missed} missed. Conditions: "
                        f"{r.get('conditions')}", ""]
    text = "\n".join(out)
    if args.out:
        open(args.out, "w").write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
