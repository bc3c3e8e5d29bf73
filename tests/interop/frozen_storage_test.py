"""Bit-for-bit check of the quantized frozen storage (Note [Frozen storage] in kernels/cpu/blocks.cpp).

Usage: python frozen_storage_test.py PATH/TO/frozen_storage_tool

For each case, values (a multiple of 64) go through `frozen_storage_tool int8|nf4 IN.f32 OUT_PREFIX`
(encode, then decode), and its stored bytes [codes | absmax as fp32] and decoded fp32 values must
equal, bit for bit:
  - nf4: a numpy reference of the Note's formulas (element 2i in the high nibble of byte i), and
    bitsandbytes' quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=False) and
    dequantize_4bit on CPU. bitsandbytes is required (scripts/requirements.txt pins it, scripts/setup
    installs it): the claim is bitsandbytes' NF4 bit for bit, which the numpy reference alone cannot
    show, so when `import bitsandbytes` fails the test fails, after still running every numpy check;
  - int8: a numpy reference of the Note's definition.
Cases: random normal (64 values and about 1M), values rounded through bf16, all-zero blocks, values
exactly on NF4 midpoints and levels times absmax (and one ulp either side), heavy tails, tiny and
denormal blocks, huge values, and int8 half-way values (k + 0.5) * absmax / 127.
Prints one line per case and storage, the first difference on a mismatch, and "N passed, M failed";
exits non-zero if anything failed.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

f32 = np.float32
BLOCK = 64

# bitsandbytes' NF4 levels (get_4bit_type("nf4")) as exact fp32 bit patterns, and the fp32 midpoints
# (level[j] + level[j + 1]) / 2 that quantize_4bit bucketizes against.
NF4 = np.array([0xBF800000, 0xBF3239B1, 0xBF066B30, 0xBECA32A0, 0xBE91A24D, 0xBE3D353F, 0xBDBA7871, 0x00000000,
                0x3DA2FAFF, 0x3E24CAE3, 0x3E7C04DD, 0x3EAD033A, 0x3EE1A4B8, 0x3F1007AB, 0x3F3913B3, 0x3F800000],
               dtype=np.uint32).view(f32)
NF4_MID = ((NF4[:-1] + NF4[1:]) / f32(2)).astype(f32)

passed = 0
failed = 0


# ----------------------------------------------------------------------------- references

def nf4_reference(x):
    """(stored bytes, decoded fp32) of the Note's NF4, every operation rounded to fp32."""
    blocks = x.reshape(-1, BLOCK)
    absmax = np.abs(blocks).max(axis=1).astype(f32)
    inv = (f32(1) / np.maximum(absmax, f32(1e-38))).astype(f32)
    scaled = np.clip((blocks * inv[:, None]).astype(f32), f32(-1), f32(1)).reshape(-1)
    q = np.searchsorted(NF4_MID, scaled, side="left").astype(np.uint8)  # midpoints below: ties go down
    codes = ((q[0::2] << 4) | q[1::2]).astype(np.uint8)
    decoded = (NF4[q].reshape(-1, BLOCK) * absmax[:, None]).astype(f32).reshape(-1)
    return np.concatenate([codes, absmax.view(np.uint8)]), decoded


def int8_reference(x):
    """(stored bytes, decoded fp32) of the Note's int8, every operation rounded to fp32:
    q = rint((x / absmax) * 127) (0 for a block of zeros), value = (q / 127) * absmax."""
    blocks = x.reshape(-1, BLOCK)
    absmax = np.abs(blocks).max(axis=1).astype(f32)
    safe = np.where(absmax > 0, absmax, f32(1)).astype(f32)
    unit = (blocks / safe[:, None]).astype(f32)
    q = np.rint((unit * f32(127)).astype(f32)).astype(np.int8).reshape(-1)  # half to even
    decoded = ((q.astype(f32).reshape(-1, BLOCK) / f32(127)).astype(f32) * absmax[:, None]).astype(f32).reshape(-1)
    return np.concatenate([q.view(np.uint8), absmax.view(np.uint8)]), decoded


def nf4_bitsandbytes(bnbf, torch, x):
    packed, state = bnbf.quantize_4bit(torch.from_numpy(x.copy()), blocksize=BLOCK, quant_type="nf4",
                                       compress_statistics=False)
    decoded = bnbf.dequantize_4bit(packed, state).reshape(-1)
    absmax = state.absmax.to(torch.float32).numpy()
    stored = np.concatenate([packed.reshape(-1).numpy().astype(np.uint8), absmax.view(np.uint8)])
    return stored, decoded.to(torch.float32).numpy()


# ----------------------------------------------------------------------------- cases

def bf16_round(x):
    """fp32 -> bf16 (round to nearest even) -> fp32; finite values only."""
    u = np.asarray(x, dtype=f32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(f32)


def block_of(values, absmax, rng):
    """A 64-element block: `values` (each |v| <= absmax), one element equal to -absmax or absmax, the
    rest zero, shuffled so neither the absmax nor any value sits at a fixed position."""
    values = np.asarray(values, dtype=f32)
    assert values.size < BLOCK and np.all(np.abs(values) <= absmax)
    b = np.zeros(BLOCK, dtype=f32)
    b[0] = absmax if rng.random() < 0.5 else -absmax
    b[1:1 + values.size] = values
    return rng.permutation(b)


def blocks_of(values, absmax, rng):
    values = np.asarray(values, dtype=f32)
    per = BLOCK - 1
    return np.concatenate([block_of(values[i:i + per], absmax, rng) for i in range(0, values.size, per)])


def near(v):
    """v and its fp32 neighbours either side."""
    v = np.asarray(v, dtype=f32)
    return np.concatenate([np.nextafter(v, f32(-np.inf)), v, np.nextafter(v, f32(np.inf))]).astype(f32)


def cases():
    rng = np.random.default_rng(20240611)
    normal = lambda n, s=1.0: (rng.standard_normal(n) * s).astype(f32)  # noqa: E731
    out = {}
    out["normal.64"] = normal(64)
    out["normal.1M"] = normal(1_000_064, 0.02)  # 15626 blocks
    out["normal.bf16"] = bf16_round(normal(64 * 129, 0.05))

    zero = np.zeros(64 * 8, dtype=f32)
    zero[64:128] = normal(64)          # a normal block between zero blocks
    zero[256:320] = f32(-0.0)          # a block of negative zeros
    zero[384 + 17] = f32(0.25)         # one non-zero element
    zero[448 + 63] = f32(-3.0)
    out["zero_blocks"] = zero

    # Values exactly on the midpoints and levels times absmax (absmax a power of two: x * inv is exact,
    # so a midpoint must take the lower level), then times absmaxes where the product rounds.
    both = np.concatenate([NF4_MID, -NF4_MID])
    mids, levels = [], []
    for a in [1.0, 0.5, 2.0 ** -20, 4096.0, 0.3, 1.7, 0.011, 3.0e-5]:
        a = f32(a)
        mids.append(blocks_of(near((both * a).astype(f32)), a, rng))
        mids.append(blocks_of((both * a).astype(f32), a, rng))
        levels.append(blocks_of(near((NF4[1:-1] * a).astype(f32)), a, rng))
        levels.append(blocks_of((np.concatenate([NF4, -NF4]) * a).astype(f32), a, rng))
    out["nf4_midpoints"] = np.concatenate(mids)
    out["nf4_levels"] = np.concatenate(levels)

    heavy = [
        (rng.standard_cauchy(64 * 64) * 0.01).astype(f32),
        rng.standard_t(1.5, 64 * 64).astype(f32),
        np.concatenate([np.r_[f32(1e4), normal(63, 1e-3)] for _ in range(16)]),  # one outlier per block
        np.concatenate([np.r_[normal(62, 1e-2), f32(-5e3), f32(5e3)] for _ in range(16)]),
    ]
    out["heavy_tailed"] = np.concatenate(heavy).astype(f32)

    # Tiny blocks: absmax below NF4's 1e-38 clamp (denormal), around it, and around 127 / FLT_MAX
    # (about 3.7e-37, where 127 / absmax would overflow); plus all-denormal blocks.
    tiny = []
    for a in [1.4e-45, 1e-44, 1e-41, 1e-40, 1e-39, 1e-38, 1.2e-38, 1e-37, 3.7e-37, 3.8e-37, 1e-36, 1e-30, 1e-20]:
        a = f32(a)
        tiny.append(np.clip((normal(64) * a).astype(f32), -a, a))
        tiny.append(block_of((rng.uniform(-1, 1, 20) * a).astype(f32), a, rng))  # zeros included
    smallest = np.nextafter(f32(0), f32(1))
    tiny.append(np.full(64, smallest, dtype=f32))
    tiny.append((rng.integers(-3, 4, 64) * smallest).astype(f32))
    out["tiny_denormal"] = np.concatenate(tiny).astype(f32)

    # A block of absmax FLT_MAX: int8's +-127 codes decode to +-absmax exactly, nothing overflows.
    huge = [np.clip(rng.standard_normal(64) * 1e38, -3.4e38, 3.4e38).astype(f32),
            block_of(normal(30), np.finfo(f32).max, rng),
            normal(64, 1e30)]
    out["huge"] = np.concatenate(huge).astype(f32)

    # int8 half-way values (k + 0.5) * absmax / 127: exact ties when absmax is 127 times a power of two,
    # near-ties otherwise.
    k = np.arange(-127, 127, dtype=np.float64) + 0.5
    halves = []
    for a in [127.0, 127.0 * 2 ** -7, 127.0 * 2 ** 10, 1.0, 0.02, 3.3, 1e-3]:
        a = f32(a)
        step = f32(a / f32(127))
        ties = (k.astype(f32) * step).astype(f32)
        halves.append(blocks_of(ties, a, rng))
        halves.append(blocks_of(near(ties[::3]), a, rng))
    out["int8_halfway"] = np.concatenate(halves)

    for name, x in out.items():
        assert x.dtype == f32 and x.size % BLOCK == 0 and np.all(np.isfinite(x)), name
    return out


# ----------------------------------------------------------------------------- checks

def bits(v):
    return f"{float(v)!r} (0x{np.asarray(v, dtype=f32).view(np.uint32):08x})"


def first_difference(x, storage, got, want):
    """A description of the first difference between (stored, decoded) pairs, or None."""
    n = x.size
    ncode = n // 2 if storage == "nf4" else n
    if got[0].size != want[0].size:
        return f"stored form has {got[0].size} bytes, expected {want[0].size}"
    if got[1].size != want[1].size:
        return f"decoded has {got[1].size} values, expected {want[1].size}"
    fields = [
        ("codes", got[0][:ncode], want[0][:ncode]),
        ("absmax", got[0][ncode:].view(np.uint32), want[0][ncode:].view(np.uint32)),
        ("decoded", got[1].view(np.uint32), want[1].view(np.uint32)),
    ]
    for field, g, w in fields:
        diff = np.flatnonzero(g != w)
        if diff.size == 0:
            continue
        i = int(diff[0])
        head = f"{field} differ at {diff.size} of {g.size} places; first index {i}"
        if field == "codes":
            elems = [2 * i, 2 * i + 1] if storage == "nf4" else [i]
            b = elems[0] // BLOCK
            inputs = ", ".join(f"x[{e}] = {bits(x[e])}" for e in elems)
            return (f"{head}: byte 0x{int(g[i]):02x}, expected 0x{int(w[i]):02x}; {inputs}; block {b} absmax "
                    f"{bits(np.abs(x[b * BLOCK:(b + 1) * BLOCK]).max())}")
        if field == "absmax":
            return (f"{head}: {bits(g[i].view(f32))}, expected {bits(w[i].view(f32))}; block "
                    f"{x[i * BLOCK:i * BLOCK + 4].tolist()}...")
        b = i // BLOCK
        return (f"{head}: x = {bits(x[i])}, decoded {bits(g[i].view(f32))}, expected {bits(w[i].view(f32))}; "
                f"block {b} absmax {bits(np.abs(x[b * BLOCK:(b + 1) * BLOCK]).max())}")
    return None


def run_tool(tool, storage, x, tmp, name):
    src = os.path.join(tmp, f"{name}.f32")
    prefix = os.path.join(tmp, f"{name}.{storage}")
    x.astype("<f4").tofile(src)
    r = subprocess.run([tool, storage, src, prefix], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None, f"tool exit {r.returncode}: {r.stderr.strip()}"
    stored = np.fromfile(prefix + ".stored", dtype=np.uint8)
    decoded = np.fromfile(prefix + ".decoded", dtype="<f4").astype(f32)
    return (stored, decoded), None


def check_case(tool, tmp, name, storage, x, bnb):
    global passed, failed
    got, error = run_tool(tool, storage, x, tmp, name)
    against = []
    if got is not None:
        refs = [("numpy", (nf4_reference if storage == "nf4" else int8_reference)(x))]
        if storage == "nf4" and bnb is not None:
            refs.append(("bitsandbytes", nf4_bitsandbytes(*bnb, x)))
        for source, want in refs:
            d = first_difference(x, storage, got, want)
            if d is not None:
                error = f"against {source}: {d}"
                break
            against.append(source)
    label = f"{name} {storage} n={x.size} blocks={x.size // BLOCK}"
    if error is None:
        passed += 1
        print(f"ok   {label}: bit for bit equal to {' and '.join(against)}", flush=True)
    else:
        failed += 1
        print(f"FAIL {label}: {error}", flush=True)


def check_refused(tool, tmp):
    """Values that are not whole blocks, and an unknown or unquantized storage, exit 2 with a message."""
    global passed, failed
    before = failed
    src = os.path.join(tmp, "ragged.f32")
    np.ones(100, dtype="<f4").tofile(src)
    for args, expect in [(["int8", src], "64-element blocks"), (["nf4", src], "64-element blocks"),
                         (["q3", src], "unknown frozen storage"), (["float32", src], "not quantized")]:
        r = subprocess.run([tool, *args, os.path.join(tmp, "ragged")], capture_output=True, text=True, timeout=60)
        if r.returncode == 2 and expect in r.stderr:
            passed += 1
        else:
            failed += 1
            print(f"FAIL refused {args[0]}: exit {r.returncode}, stderr {r.stderr.strip()!r}, expected {expect!r}")
    if failed == before:
        print("ok   refusals: ragged input, unknown and unquantized storage exit 2 with a message", flush=True)


def import_bitsandbytes():
    """(bitsandbytes.functional, torch), or None after counting and printing a failure."""
    global failed
    try:
        import torch
        import bitsandbytes.functional as bnbf
        torch.set_num_threads(1)
        return bnbf, torch
    except Exception as e:  # noqa: BLE001 - any failure to load it fails the test, with its reason
        failed += 1
        print(f"FAIL bitsandbytes does not import ({type(e).__name__}: {e}): NF4 must equal bitsandbytes' "
              f"quantize_4bit bit for bit, which this test cannot check without it. Run scripts/setup, which "
              f"installs bitsandbytes into .venv (pinned in scripts/requirements.txt). The numpy checks run "
              f"anyway.", flush=True)
        return None


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    tool = sys.argv[1]
    bnb = import_bitsandbytes()
    with tempfile.TemporaryDirectory(prefix="frozen_storage.") as tmp:
        for name, x in cases().items():
            for storage in ("nf4", "int8"):
                check_case(tool, tmp, name, storage, x, bnb)
        check_refused(tool, tmp)
    if bnb is None:
        print("FAIL NF4 not compared with bitsandbytes: it does not import (first line); run scripts/setup")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
