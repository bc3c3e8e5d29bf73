"""scripts/tensorboard against TensorBoard's own readers.

Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train .venv/bin/python tests/interop/tensorboard_test.py
(ctest sets them.)

  1. A tiny fsdp-train job (2 ranks under fsdp-run, 6 steps, evaluations at 0, 3 and 6) writes its
     metrics while `scripts/tensorboard --follow --pid` converts them live (started before the file
     exists, stopping once the job has exited); then a one-shot conversion of the same file. Both
     folders, read back with tensorboard.backend.event_processing.event_accumulator.EventAccumulator:
     the same tags as the JSONL's numbers (train/loss, train/lr, train/step_time_s,
     train/tokens_per_s, train/peak_rss_bytes/rankK, ..., eval/loss, eval/perplexity), each with the
     JSONL's steps and values, exactly.
  2. A resumed run's file (steps trained again, an evaluation orphaned by the crash), a half-written
     line, an --init-only line, null and boolean values; read back with plugin_event_accumulator,
     the reader TensorBoard's server uses: the later lines win, the orphaned values are gone.
  3. Refusals: a LOGDIR that already holds event files, a missing metrics file, --pid without --follow.
Prints one line per check and "N passed, M failed"; exits non-zero if anything failed.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "tensorboard")
TINY = ["--set", "model.vocab_size=64", "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64",
        "--set", "model.num_hidden_layers=2", "--set", "model.num_attention_heads=4",
        "--set", "model.num_key_value_heads=2", "--set", "data.seq_len=16", "--set", "data.batch_size_per_rank=4",
        "--set", "train.eval_every=3", "--set", "train.log_every=1", "--set", "optim.warmup_steps=2",
        "--set", "fsdp.timeout_s=60", "--steps", "6"]

passed = 0
failed = 0


def check(name, ok, detail=""):
    global passed, failed
    print(("PASS " if ok else "FAIL ") + name + ("" if ok or not detail else f"\n    {detail}"))
    if ok:
        passed += 1
    else:
        failed += 1


# ---- the expectation, from the JSONL alone ------------------------------------------------------

def numbers(prefix, value, out):
    """(tag, float) for every number (true/false as 1/0) under `value`; list items are ranks."""
    if isinstance(value, bool):
        out.append((prefix, float(value)))
    elif isinstance(value, (int, float)):
        out.append((prefix, float(value)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            numbers(f"{prefix}/rank{i}", v, out)
    elif isinstance(value, dict):
        for k, v in value.items():
            numbers(f"{prefix}/{k}", v, out)


def expected(path):
    """{tag: [(step, value)]}: what TensorBoard should show for the metrics file at `path`. A training
    step not beyond the last one is a restart: every value at that step or later is dropped first."""
    series = {}
    last_train = None
    with open(path) as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if line.get("init_only"):
                kind, step = "init", 0
            else:
                kind, step = ("eval" if line.get("eval") else "train"), line["step"]
            if kind == "train":
                if last_train is not None and step <= last_train:
                    series = {t: [(s, v) for s, v in pts if s < step] for t, pts in series.items()}
                last_train = step
            out = []
            for k, v in line.items():
                if k not in ("step", "eval", "init_only"):
                    numbers(f"{kind}/{k}", v, out)
            for tag, v in out:
                series.setdefault(tag, []).append((step, v))
    return {t: sorted(pts) for t, pts in series.items() if pts}


def read_back(logdir, plugin):
    """{tag: [(step, value)]} as TensorBoard reads LOGDIR, and each tag's plugin name."""
    from tensorboard.util import tensor_util
    if plugin:
        from tensorboard.backend.event_processing import plugin_event_accumulator as ea
    else:
        from tensorboard.backend.event_processing import event_accumulator as ea
    acc = ea.EventAccumulator(logdir, size_guidance={ea.TENSORS: 0})
    acc.Reload()
    series, plugins = {}, {}
    for tag in acc.Tags()["tensors"]:
        pts = sorted((e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag))
        if pts:
            series[tag] = pts
        plugins[tag] = acc.SummaryMetadata(tag).plugin_data.plugin_name
    return series, plugins


def compare(name, want, got):
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = [t for t in sorted(set(want) & set(got)) if want[t] != got[t]]
    detail = f"missing {missing[:5]}, extra {extra[:5]}, differing {[(t, want[t], got[t]) for t in wrong[:2]]}"
    check(f"{name}: {len(want)} tags, every step and value as in the JSONL", not missing and not extra and not wrong,
          detail)


def tensorboard(*args, **kw):
    return subprocess.run([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, **kw)


# ---- 1. a real run, followed live and converted once -------------------------------------------

def real_run(tmp, programs):
    metrics = os.path.join(tmp, "run.jsonl")
    live, once = os.path.join(tmp, "live"), os.path.join(tmp, "once")
    follower = None
    with open(os.path.join(tmp, "run.out"), "w") as log, open(os.path.join(tmp, "follow.out"), "w") as flog:
        job = subprocess.Popen([programs["FSDP_RUN"], "--nproc-per-node", "2", "--timeout-s", "120", "--",
                                programs["FSDP_TRAIN"], *TINY, "--metrics", metrics],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
        follower = subprocess.Popen([sys.executable, SCRIPT, metrics, live, "--follow", "--pid", str(job.pid)],
                                    stdout=flog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        rc = job.wait(timeout=300)  # reaped here, so the follower sees it gone
        try:
            frc = follower.wait(timeout=60)
        except subprocess.TimeoutExpired:
            follower.kill()
            frc = "timed out"
    check(f"tiny fsdp-train job (exit {rc})", rc == 0, open(os.path.join(tmp, "run.out")).read()[-2000:])
    if rc != 0:
        return
    check(f"--follow --pid stops once the job has exited (exit {frc})", frc == 0,
          open(os.path.join(tmp, "follow.out")).read()[-1000:])
    r = tensorboard(metrics, once)
    check(f"one-shot conversion (exit {r.returncode})", r.returncode == 0, r.stdout)

    want = expected(metrics)
    for tag in ("train/loss", "train/lr", "train/step_time_s", "train/tokens_per_s", "train/peak_rss_bytes/rank0",
                "train/peak_rss_bytes/rank1", "train/allgather_bytes/rank1", "eval/loss", "eval/perplexity"):
        check(f"the JSONL has {tag}", tag in want, sorted(want))
    check("the JSONL has steps 1..6 and evaluations at 0 (before training), 3 and 6",
          [s for s, _ in want.get("train/loss", [])] == [1, 2, 3, 4, 5, 6] and
          [s for s, _ in want.get("eval/loss", [])] == [0, 3, 6], (want.get("train/loss"), want.get("eval/loss")))
    for name, logdir in (("followed live", live), ("converted once", once)):
        got, plugins = read_back(logdir, plugin=False)
        compare(f"{name}, event_accumulator", want, got)
        check(f"{name}: every tag is a scalar (the scalars plugin)", set(plugins.values()) == {"scalars"},
              set(plugins.values()))


# ---- 2. a resumed run, corrupt and special lines -------------------------------------------------

def resumed_file(tmp):
    metrics = os.path.join(tmp, "resumed.jsonl")
    lines = [
        {"init_only": True, "peak_rss_bytes": [1000, 2000]},
        {"step": 1, "loss": 4.5, "lr": 1e-3, "tokens_per_s": 100.25, "peak_rss_bytes": [2**40 + 1, 7], "skipped": False,
         "phase_s": {"forward": 0.125}, "phase_peak_rss_bytes": {"forward": [5, 6]}},
        {"step": 2, "loss": 4.25, "lr": 2e-3, "skipped": True},
        {"eval": True, "step": 2, "loss": 4.0, "perplexity": 54.598150033144236},
        {"step": 3, "loss": 4.0, "lr": 3e-3},
        {"eval": True, "step": 3, "loss": 800.0, "perplexity": None},
    ]
    with open(metrics, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write('{"step": 4, "loss": 3.')  # killed mid-write
        f.write("\n")
        for line in ({"step": 2, "loss": 4.3, "lr": 2e-3, "skipped": False}, {"step": 3, "loss": 3.9, "lr": 3e-3}):
            f.write(json.dumps(line) + "\n")  # resumed from the checkpoint at step 1
    logdir = os.path.join(tmp, "resumed")
    r = tensorboard(metrics, logdir)
    check(f"resumed file converted (exit {r.returncode}), the half line skipped with its line number",
          r.returncode == 0 and "resumed.jsonl:7: skipped" in r.stdout and "(1 skipped)" in r.stdout, r.stdout)
    want = expected(metrics)
    check("expectation: the resumed run's values win, the orphaned evaluations are gone",
          want["train/loss"] == [(1, 4.5), (2, 4.3), (3, 3.9)] and "eval/loss" not in want and
          want["init/peak_rss_bytes/rank1"] == [(0, 2000.0)] and want["train/skipped"] == [(1, 0.0), (2, 0.0)] and
          want["train/peak_rss_bytes/rank0"] == [(1, float(2**40 + 1))], want)
    got, _ = read_back(logdir, plugin=True)
    compare("resumed file, plugin_event_accumulator", want, got)


# ---- 3. refusals ---------------------------------------------------------------------------------

def refusals(tmp):
    metrics = os.path.join(tmp, "small.jsonl")
    with open(metrics, "w") as f:
        f.write(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    logdir = os.path.join(tmp, "twice")
    first = tensorboard(metrics, logdir)
    second = tensorboard(metrics, logdir)
    check("a LOGDIR that already holds event files is refused (exit 2), nothing added",
          first.returncode == 0 and second.returncode == 2 and "already holds event files" in second.stdout and
          len(os.listdir(logdir)) == 1, first.stdout + second.stdout)
    r = tensorboard(os.path.join(tmp, "none.jsonl"), os.path.join(tmp, "none"))
    check("a missing metrics file is an error (exit 2)", r.returncode == 2 and "no such file" in r.stdout, r.stdout)
    r = tensorboard(metrics, os.path.join(tmp, "pid"), "--pid", "1")
    check("--pid without --follow is a usage error", r.returncode == 2 and "--pid needs --follow" in r.stdout, r.stdout)


def main():
    programs = {var: os.environ.get(var, "") for var in ("FSDP_RUN", "FSDP_TRAIN")}
    tmp = tempfile.mkdtemp(prefix="fsdp-tensorboard-")
    try:
        if all(programs.values()):
            real_run(tmp, programs)
        else:
            check("FSDP_RUN and FSDP_TRAIN are set", False, str(programs))
        resumed_file(tmp)
        refusals(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
