#!/usr/bin/env python3
"""This machine's bf16 matrix-product rate as a rank sees it: PROCS processes at once (as many as a
run has ranks), each on one thread, each timing [tokens x hidden] by [hidden x inner] (a rank's
tokens through a Llama gate projection). Prints each process's GFLOP/s: the figure a step's
products are held against (docs/NOTES.md, "Where the Llama-3.1-8B QLoRA step's time goes").

Usage: bench/matmul_rate.py [--procs 2] [--tokens 128] [--hidden 4096] [--inner 14336] [--reps 40]
       (the venv's python; run it on a quiet machine)
"""
import argparse
import multiprocessing as mp
import time


def rate(args, out):
    import torch
    torch.set_num_threads(1)
    a = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16)
    b = torch.randn(args.hidden, args.inner, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(args.reps):
        a @ b
    out.put(2 * args.tokens * args.hidden * args.inner * args.reps / (time.perf_counter() - t) / 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inner", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    out = mp.Queue()
    procs = [mp.Process(target=rate, args=(args, out)) for _ in range(args.procs)]
    for p in procs:
        p.start()
    rates = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"bf16 [{args.tokens} x {args.hidden}] x [{args.hidden} x {args.inner}], {args.procs} processes of 1 thread: "
          + ", ".join(f"{r:.1f}" for r in rates) + " GFLOP/s")


if __name__ == "__main__":
    main()
