"""fsdp-train step time, build A against build B, interleaved in one run: did a change cost time?

Runs the same fsdp-train job (2 ranks through fsdp-run, the communication-bound and the
compute-bound configs of scripts/bench compare) alternately with A's and B's binaries, REPEATS
times, and reports each build's median step time (after 2 warm-up steps, median over steps, then
median over repeats), B/A, and whether the losses are bitwise the same. Exits non-zero when the
losses differ (a refactor must not change results).

    .venv/bin/python bench/ab_step_time.py --a OLD/build/bin --b build/bin [--repeats 3] [--steps 10]
        [--configs comm,compute] [--env-a KEY=VALUE ...] [--env-b KEY=VALUE ...]

The same build under two settings: --a and --b the same folder, with --env-a / --env-b, e.g.
    --a build/bin --b build/bin --env-a FSDP_CPU_TRANSPORT=gloo   (Gloo against shared memory)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# glibc's malloc thresholds that fsdp sets for itself at init (Note [Host malloc settings] in
# src/base/host_malloc.cpp): the benchmarks give them to every system they compare, so that no
# system pays page faults on recycled buffers that another does not.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4194304:glibc.malloc.trim_threshold=536870912"

CONFIGS = {
    "comm": ["model.hidden_size=256", "model.intermediate_size=688", "model.num_hidden_layers=4",
             "model.num_attention_heads=8", "model.num_key_value_heads=8", "data.seq_len=64",
             "data.batch_size_per_rank=1"],
    "compute": ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_hidden_layers=6",
                "model.num_attention_heads=8", "model.num_key_value_heads=8", "data.seq_len=256",
                "data.batch_size_per_rank=4"],
}


def run(bin_dir, cfg, steps, ranks, metrics, extra_env):
    cmd = [os.path.join(bin_dir, "fsdp-run"), "--nproc-per-node", str(ranks), "--",
           os.path.join(bin_dir, "fsdp-train"), "--steps", str(steps), "--metrics", metrics,
           "--set", "train.eval_every=0", "--set", "optim.warmup_steps=2"]
    for kv in CONFIGS[cfg]:
        cmd += ["--set", kv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(kv.split("=", 1) for kv in extra_env)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    rows = [r for r in rows if not r.get("eval")]
    return [r["step_time_s"] for r in rows[2:]], [r["loss"] for r in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="bin folder of build A (the baseline)")
    ap.add_argument("--b", required=True, help="bin folder of build B (the change)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: comm, compute")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--env-a", nargs="*", default=[], help="KEY=VALUE set for A's runs")
    ap.add_argument("--env-b", nargs="*", default=[], help="KEY=VALUE set for B's runs")
    args = ap.parse_args()
    out = {}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in args.configs.split(","):
            medians = {"a": [], "b": []}
            losses = {}
            for rep in range(args.repeats):
                for side in ("a", "b"):
                    times, loss = run(getattr(args, side), cfg, args.steps, args.ranks,
                                      os.path.join(tmp, f"{cfg}-{side}-{rep}.jsonl"),
                                      getattr(args, f"env_{side}"))
                    medians[side].append(statistics.median(times))
                    losses.setdefault(side, loss)
            a, b = statistics.median(medians["a"]), statistics.median(medians["b"])
            equal = losses["a"] == losses["b"]
            same = same and equal
            out[cfg] = {"a_step_s": a, "b_step_s": b, "b_over_a": b / a, "a_repeats": medians["a"],
                        "b_repeats": medians["b"], "losses_bitwise_equal": equal}
            print(f"{cfg:8s} A {a * 1e3:8.1f} ms  B {b * 1e3:8.1f} ms  B/A {b / a:.3f}  "
                  f"(A repeats {', '.join(f'{x * 1e3:.1f}' for x in medians['a'])}; "
                  f"B repeats {', '.join(f'{x * 1e3:.1f}' for x in medians['b'])})  "
                  f"losses {'bitwise equal' if equal else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    if not same:
        print("ab_step_time: the two builds' losses differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
