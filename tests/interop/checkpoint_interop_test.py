"""Interop between our sharded checkpoints and the Python `safetensors` package, both directions.

Usage: python checkpoint_interop_test.py PATH/TO/checkpoint_interop_tool

(a) `checkpoint_interop_tool write DIR` trains a sharded Net on 2 ranks and saves
    DIR/step-00000002; it also writes DIR/expected.json from an unsharded reference trained with
    the same math. `safetensors.torch.load_file` must read model.safetensors and the optimizer
    files, each index's weight_map must name exactly the tensors its files hold, and every model
    tensor (and exp_avg) must match the reference: shape exactly, sums and first values to 1e-4.
(b) Python writes checkpoint directories for the same Net with `save_file` (one file, and the
    Hugging Face split over two files) holding known random values, plus the index and
    train_state.json; `checkpoint_interop_tool read` must load them and print the same sums.
    A directory whose tensor has another shape must be refused, naming the tensor.
Prints "N passed, M failed" and exits non-zero if anything failed.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

# The tool's Net (kept in step with net_options() in checkpoint_interop_tool.cpp).
NET = {"in": 7, "dim": 15, "hidden": 13, "out": 5, "blocks": 2}
TOL = 1e-4
STEP_DIR = "step-00000002"

passed = 0
failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}", flush=True)


def close(a, b):
    return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL)


def net_shapes():
    """name -> shape in named_parameters() order."""
    shapes = {"inp.weight": [NET["dim"], NET["in"]], "inp.bias": [NET["dim"]]}
    for i in range(NET["blocks"]):
        shapes[f"blocks_{i}.fc1.weight"] = [NET["hidden"], NET["dim"]]
        shapes[f"blocks_{i}.fc1.bias"] = [NET["hidden"]]
        shapes[f"blocks_{i}.fc2.weight"] = [NET["dim"], NET["hidden"]]
        shapes[f"blocks_{i}.fc2.bias"] = [NET["dim"]]
    shapes["head.weight"] = [NET["out"], NET["dim"]]
    shapes["head.bias"] = [NET["out"]]
    return shapes


def weighted_sum(t):
    v = t.to(torch.float64).flatten()
    w = torch.remainder(torch.arange(v.numel(), dtype=torch.float64), 7) + 1
    return (v * w).sum().item()


def run_tool(tool, *args):
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=240)


def check_file_set(ckpt, kind, names):
    """The index of `kind` names exactly the tensors its files hold, and those are `names`.
    Returns the loaded tensors by name."""
    index_path = os.path.join(ckpt, f"{kind}.safetensors.index.json")
    check(os.path.exists(index_path), f"{index_path} missing")
    if not os.path.exists(index_path):
        return {}
    with open(index_path) as f:
        index = json.load(f)
    check(set(index) == {"metadata", "weight_map"}, f"{kind} index keys {sorted(index)}")
    weight_map = index.get("weight_map", {})
    loaded, holder = {}, {}
    for file in sorted(set(weight_map.values())):
        tensors = load_file(os.path.join(ckpt, file))
        for name, t in tensors.items():
            check(name not in holder, f"{kind}: {name} in both {holder.get(name)} and {file}")
            holder[name] = file
            loaded[name] = t
    check(set(weight_map) == set(holder), f"{kind}: weight_map names {sorted(set(weight_map) ^ set(holder))} "
                                          "that the files do not hold, or misses tensors they hold")
    check(all(holder.get(n) == f for n, f in weight_map.items()), f"{kind}: weight_map points at the wrong file")
    check(set(loaded) == set(names), f"{kind}: tensors {sorted(set(loaded) ^ set(names))} differ from the model's")
    for name, t in loaded.items():
        check(t.dtype == torch.float32, f"{kind}: {name} is {t.dtype}, expected float32")
    return loaded


def compare(kind, name, t, shape, total, first, wsum=None):
    check(list(t.shape) == shape, f"{kind} {name}: shape {list(t.shape)}, expected {shape}")
    got = t.to(torch.float64).flatten()
    check(close(got.sum().item(), total), f"{kind} {name}: sum {got.sum().item()!r}, expected {total!r}")
    got_first = got[: len(first)].tolist()
    check(len(got_first) == len(first) and all(close(a, b) for a, b in zip(got_first, first)),
          f"{kind} {name}: first values {got_first}, expected {first}")
    if wsum is not None:
        check(close(weighted_sum(t), wsum), f"{kind} {name}: weighted sum {weighted_sum(t)!r}, expected {wsum!r}")


def test_tool_written_checkpoint(tool, tmp):
    root = os.path.join(tmp, "from_tool")
    r = run_tool(tool, "write", root)
    check(r.returncode == 0, f"tool write exit {r.returncode}: {r.stderr}")
    if r.returncode != 0:
        return
    ckpt = os.path.join(root, STEP_DIR)
    print(f"tool wrote {ckpt}")
    with open(os.path.join(root, "expected.json")) as f:
        expected = json.load(f)
    check(expected["net"] == NET, f"tool's Net {expected['net']}, test's {NET}")
    shapes = net_shapes()
    want = expected["tensors"]
    check(sorted(want) == sorted(shapes), f"reference names {sorted(want)}, expected {sorted(shapes)}")

    with open(os.path.join(root, "latest")) as f:
        check(f.read().strip() == STEP_DIR, "latest does not name the checkpoint")
    with open(os.path.join(ckpt, "train_state.json")) as f:
        state = json.load(f)
    check(state.get("format_version") == 1 and state.get("step") == 2 and state.get("samples_seen") == 24
          and state.get("world_size") == 2 and state.get("strategy") == "FULL_SHARD",
          f"train_state.json {state}")

    model = check_file_set(ckpt, "model", shapes)
    check("model.safetensors" in os.listdir(ckpt), "no model.safetensors")
    exp_avg = check_file_set(ckpt, "optim.exp_avg", shapes)
    exp_avg_sq = check_file_set(ckpt, "optim.exp_avg_sq", shapes)
    for name, w in want.items():
        check(w["shape"] == shapes[name], f"reference {name}: shape {w['shape']}, expected {shapes[name]}")
        if name in model:
            compare("model", name, model[name], w["shape"], w["sum"], w["first"], w["wsum"])
        if name in exp_avg:
            compare("exp_avg", name, exp_avg[name], w["shape"], w["exp_avg_sum"], w["exp_avg_first"])
        if name in exp_avg_sq:
            check(bool((exp_avg_sq[name] > 0).any()), f"exp_avg_sq {name} is all zero")


def python_params():
    g = torch.Generator().manual_seed(4321)
    return {n: torch.randn(*s, generator=g, dtype=torch.float32) for n, s in net_shapes().items()}


def write_python_checkpoint(ckpt, params, files):
    """files: file name -> list of tensor names it holds."""
    os.makedirs(ckpt)
    weight_map = {}
    for file, names in files.items():
        save_file({n: params[n].contiguous() for n in names}, os.path.join(ckpt, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(ckpt, "train_state.json"), "w") as f:
        json.dump({"format_version": 1, "step": 7, "samples_seen": 84, "world_size": 1, "strategy": "FULL_SHARD",
                   "rng_states": [], "extra": {}}, f)


def parse_read(text):
    out = {}
    for line in text.splitlines():
        fields = line.split()
        check(len(fields) == 3, f"unexpected read line {line!r}")
        if len(fields) == 3:
            out[fields[0]] = (float(fields[1]), float(fields[2]))
    return out


def test_python_written_checkpoint(tool, tmp):
    params = python_params()
    names = list(params)
    layouts = {
        "one file": {"model.safetensors": names},
        "two files": {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                      "model-00002-of-00002.safetensors": names[len(names) // 2:]},
    }
    for label, files in layouts.items():
        ckpt = os.path.join(tmp, "from_python_" + label.replace(" ", "_"))
        write_python_checkpoint(ckpt, params, files)
        r = run_tool(tool, "read", ckpt)
        check(r.returncode == 0, f"{label}: tool read exit {r.returncode}: {r.stderr}")
        if r.returncode != 0:
            continue
        print(f"python wrote {ckpt} ({label}); tool read it")
        got = parse_read(r.stdout)
        check(list(got) == names, f"{label}: read names {list(got)}, expected {names}")
        for name, t in params.items():
            if name not in got:
                continue
            total, wsum = got[name]
            want_total = t.to(torch.float64).sum().item()
            check(close(total, want_total), f"{label} {name}: sum {total!r}, expected {want_total!r}")
            check(close(wsum, weighted_sum(t)), f"{label} {name}: weighted sum {wsum!r}, expected {weighted_sum(t)!r}")

    # Another architecture's tensor: refused, naming the tensor and both shapes.
    wrong = dict(params)
    wrong["blocks_1.fc2.weight"] = torch.zeros(NET["dim"], NET["hidden"] + 1)
    ckpt = os.path.join(tmp, "from_python_wrong_shape")
    write_python_checkpoint(ckpt, wrong, {"model.safetensors": names})
    r = run_tool(tool, "read", ckpt)
    check(r.returncode == 1 and "'blocks_1.fc2.weight' has shape [15, 14] but the model's has shape [15, 13]" in r.stderr,
          f"wrong shape: exit {r.returncode}, stderr {r.stderr!r}")


def main():
    if len(sys.argv) != 2:
        print("usage: checkpoint_interop_test.py PATH/TO/checkpoint_interop_tool", file=sys.stderr)
        return 2
    tool = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="fsdp-ckpt-interop-")
    try:
        test_tool_written_checkpoint(tool, tmp)
        test_python_written_checkpoint(tool, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
