"""Interop between our safetensors code and the Python `safetensors` package, both directions.

Usage: python safetensors_interop_test.py PATH/TO/safetensors_tool

(a) `safetensors_tool write` makes a file from plan_file + positioned writes; the Python package
    must load it with the exact values the tool documents (keep VALUES in step with the tool).
(b) Python `save_file` writes a file with several dtypes, odd shapes, a 0-d scalar and an empty
    tensor; `safetensors_tool dump` must validate it and report the same names, dtypes, shapes and
    sums. Damaged copies of it must be refused with a message naming the file.
Prints "N passed, M failed" and exits non-zero if anything failed.
"""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# What `safetensors_tool write` writes: name -> (dtype, shape). Values: see values_for().
TOOL_TENSORS = {
    "layers.0.f64": ("F64", [4]),
    "layers.0.i64": ("I64", [2, 3]),
    "layers.0.u64": ("U64", [3]),
    "layers.0.f32": ("F32", [3, 5]),
    "layers.0.scalar": ("F32", []),
    "layers.0.empty": ("F32", [0, 3]),
    "layers.0.i32": ("I32", [5]),
    "layers.0.u32": ("U32", [2, 2]),
    "layers.0.bf16": ("BF16", [7, 2]),
    "layers.0.f16": ("F16", [2, 3, 1]),
    "layers.0.i16": ("I16", [3]),
    "layers.0.u16": ("U16", [3]),
    "layers.1.odd.bf16": ("BF16", [7]),
    "layers.1.i8": ("I8", [9]),
    "layers.1.u8": ("U8", [4, 4]),
    "layers.1.bool": ("BOOL", [6]),
    "layers.1.f8_e4m3": ("F8_E4M3", [5]),
    "layers.1.f8_e5m2": ("F8_E5M2", [17]),
}
SCALE = {"I8": 1, "U8": 1, "I16": 256, "U16": 256, "I32": 2**20, "U32": 2**20,
         "I64": 2**40, "U64": 2**40}

passed = 0
failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}", flush=True)


def values_for(dtype, shape):
    """The tool's values as float64 (bool as 0/1), element i of the row-major tensor."""
    n = math.prod(shape)
    i = torch.arange(n, dtype=torch.float64)
    if dtype == "BOOL":
        v = (torch.remainder(i, 3) == 0).to(torch.float64)
    elif dtype.startswith("U"):
        v = torch.remainder(i, 17) * SCALE[dtype]
    elif dtype.startswith("I"):
        v = (torch.remainder(i, 17) - 8) * SCALE[dtype]
    else:
        v = (torch.remainder(i, 17) - 8) * 0.25
    return v.reshape(shape)


def run_tool(tool, *args):
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)


def header_of(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def test_tool_written_file(tool, tmp):
    path = os.path.join(tmp, "tool.safetensors")
    r = run_tool(tool, "write", path)
    check(r.returncode == 0, f"tool write exit {r.returncode}: {r.stderr}")
    if r.returncode != 0:
        return
    print(f"tool wrote {path}")
    loaded = load_file(path)
    check(set(loaded) == set(TOOL_TENSORS), f"names {sorted(loaded)}")
    for name, (dtype, shape) in TOOL_TENSORS.items():
        t = loaded.get(name)
        if t is None:
            continue
        check(t.dtype == DTYPES[dtype], f"{name}: dtype {t.dtype}, expected {dtype}")
        check(list(t.shape) == shape, f"{name}: shape {list(t.shape)}, expected {shape}")
        got = t.to(torch.float64)
        want = values_for(dtype, shape)
        check(got.shape == want.shape and torch.equal(got, want),
              f"{name}: values {got.flatten()[:8].tolist()} expected {want.flatten()[:8].tolist()}")
    with safe_open(path, framework="pt") as f:
        check(f.metadata() == {"format": "pt", "writer": "safetensors_tool"},
              f"metadata {f.metadata()}")
    n, header = header_of(path)
    check((8 + n) % 8 == 0, f"data starts at {8 + n}, not 8-byte aligned")
    check("__metadata__" in header, "no __metadata__ in the tool's header")
    # Same input, same bytes: every rank must be able to compute the layout alone.
    again = os.path.join(tmp, "tool2.safetensors")
    r = run_tool(tool, "write", again)
    with open(path, "rb") as a, open(again, "rb") as b:
        check(r.returncode == 0 and a.read() == b.read(), "two tool writes differ")


def python_tensors():
    g = torch.Generator().manual_seed(1234)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    def randint(lo, hi, *shape, dtype):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)

    return {
        "model.embed_tokens.weight": randn(7, 15),
        "model.layers.0.attn.q_proj.weight": randn(3, 5, dtype=torch.bfloat16),
        "model.layers.0.mlp.up.bias": randn(13, dtype=torch.float16),
        "model.layers.0.norm.weight": randn(2, 2, 2, dtype=torch.float64),
        "model.scalar": torch.tensor(3.5, dtype=torch.float32),
        "model.empty": torch.zeros(0, 3, dtype=torch.float32),
        "model.empty_bf16": torch.zeros(4, 0, dtype=torch.bfloat16),
        "counts.i64": randint(-(2**50), 2**50, 5, dtype=torch.int64),
        "counts.i32": randint(-(2**30), 2**30, 3, 3, dtype=torch.int32),
        "counts.i16": randint(-30000, 30000, 9, dtype=torch.int16),
        "counts.i8": randint(-128, 128, 11, dtype=torch.int8),
        "counts.u8": randint(0, 256, 1, 17, dtype=torch.uint8),
        "counts.u16": randint(0, 65536, 6, dtype=torch.uint16),
        "counts.u32": randint(0, 2**32, 6, dtype=torch.uint32),
        "counts.u64": randint(0, 2**52, 6, dtype=torch.uint64),
        "mask": randint(0, 2, 10, dtype=torch.bool),
        "fp8.e4m3": randn(1, 7, dtype=torch.float8_e4m3fn),
        "fp8.e5m2": randn(9, dtype=torch.float8_e5m2),
    }


def dtype_name(dtype):
    return next(k for k, v in DTYPES.items() if v == dtype)


def parse_dump(text):
    tensors, metadata = {}, {}
    for line in text.splitlines():
        fields = line.split("\t")
        if fields[0] == "tensor" and len(fields) == 6:
            shape = json.loads(fields[3])
            tensors[fields[1]] = (fields[2], shape, float(fields[4]), float(fields[5]))
        elif fields[0] == "metadata" and len(fields) == 3:
            metadata[fields[1]] = fields[2]
        else:
            check(False, f"unexpected dump line {line!r}")
    return tensors, metadata


def close(a, b):
    return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


def test_python_written_file(tool, tmp):
    path = os.path.join(tmp, "python.safetensors")
    tensors = python_tensors()
    save_file(tensors, path, metadata={"source": "python", "format": "pt"})
    print(f"python wrote {path}")
    r = run_tool(tool, "dump", path)
    check(r.returncode == 0, f"tool dump exit {r.returncode}: {r.stderr}")
    if r.returncode != 0:
        return path
    dumped, metadata = parse_dump(r.stdout)
    check(metadata == {"source": "python", "format": "pt"}, f"metadata {metadata}")
    check(set(dumped) == set(tensors), f"names {sorted(dumped)}")
    for name, t in tensors.items():
        if name not in dumped:
            continue
        dtype, shape, total, weighted = dumped[name]
        check(dtype == dtype_name(t.dtype), f"{name}: dtype {dtype}, expected {dtype_name(t.dtype)}")
        check(shape == list(t.shape), f"{name}: shape {shape}, expected {list(t.shape)}")
        v = t.to(torch.float64).flatten()
        w = torch.remainder(torch.arange(v.numel(), dtype=torch.float64), 7) + 1
        want_total, want_weighted = v.sum().item(), (v * w).sum().item()
        check(close(total, want_total), f"{name}: sum {total!r}, expected {want_total!r}")
        check(close(weighted, want_weighted),
              f"{name}: weighted sum {weighted!r}, expected {want_weighted!r}")
    return path


def test_damaged_files(tool, tmp, good_path):
    with open(good_path, "rb") as f:
        good = f.read()
    n = struct.unpack("<Q", good[:8])[0]
    cases = {
        "truncated.safetensors": (good[:-1], "runs past the end of the data buffer"),
        "trailing.safetensors": (good + b"\0", "trailing"),
        "short.safetensors": (good[:5], "too short"),
        "bad_length.safetensors": (struct.pack("<Q", len(good)) + good[8:], "runs past the end"),
        "too_long.safetensors": (struct.pack("<Q", 100_000_001) + good[8:], "limit"),
        "bad_dtype.safetensors": (good.replace(b'"F32"', b'"F99"', 1), "unknown dtype 'F99'"),
    }
    for name, (data, needle) in cases.items():
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        r = run_tool(tool, "dump", path)
        check(r.returncode == 1, f"{name}: dump exit {r.returncode}, expected 1")
        check(path in r.stderr and needle in r.stderr,
              f"{name}: message {r.stderr.strip()!r} lacks the path or {needle!r}")
    check(n < len(good), "python file has a header")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    tool = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="safetensors_interop.") as tmp:
        test_tool_written_file(tool, tmp)
        good = test_python_written_file(tool, tmp)
        test_damaged_files(tool, tmp, good)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
