"""The PyTorch FSDP2 side of `bench/scale.py`: the same Hugging Face model, data and optimizer as
fsdp-train's train phase, trained with FSDP2 in its recommended setup, on CPU over Gloo.

Every rank loads the Hugging Face directory with transformers in fp32 (the whole model per rank, as
a plain `from_pretrained` does), then `fully_shard` goes on every decoder layer and on the root with
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32). The batches are fsdp-train's own,
written by `bench_unsharded --dump-data` (as for bench/compare_fsdp2.py). AdamW (fused CPU kernel) with
fsdp's two parameter groups (weight decay on parameters of 2 or more dimensions, none on 1-D ones),
fsdp-train's LR schedule (linear warmup, then cosine to min_lr or constant) and global-norm
clipping; the optimizer settings come as JSON from bench/scale.py, which reads fsdp-train's
defaults from `fsdp-train --help`.

Prints a marker line before each phase ("scale_fsdp2: phase load|shard|step N|done", flushed) so
that a run killed for memory tells where it ran out, and writes one JSON line per finished phase to
--out (rank 0): {"phase", "wall_s", "peak_rss_bytes": [per rank], and for steps "loss", "lr"}.

Launch: torchrun --standalone --nproc-per-node 2 bench/scale_fsdp2.py --hf DIR --data batches.bin \
            --seq-len 128 --batch 1 --steps 3 --optim '{"lr": ...}' --out fsdp2.jsonl
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from compare_fsdp2 import lr_at, peak_rss_bytes  # fsdp-train's LR schedule; this process's peak RSS

def gather(values):
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--data", required=True, help="batches written by bench_unsharded --dump-data --world 2")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--optim", required=True, help="fsdp-train's optim section as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    optim_cfg = json.loads(args.optim)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = open(args.out, "w") if rank == 0 else None

    def mark(phase):
        if rank == 0:
            print(f"scale_fsdp2: phase {phase}", flush=True)

    def record(phase, t0, **extra):
        dt = time.monotonic() - t0
        ranks = gather([peak_rss_bytes()] + list(extra.pop("_local", [])))
        if out is not None:
            line = {"phase": phase, "wall_s": dt, "peak_rss_bytes": [r[0] for r in ranks], **extra}
            if len(ranks[0]) > 1:
                line["loss"] = sum(r[1] for r in ranks) / world
            out.write(json.dumps(line) + "\n")
            out.flush()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (world,))
    record("init", time.monotonic())
    mark("load")
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    record("load", t0)

    mark("shard")
    t0 = time.monotonic()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": optim_cfg["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=optim_cfg["lr"], betas=tuple(optim_cfg["betas"]), eps=optim_cfg["eps"],
                                  fused=True)
    record("shard", t0)

    seq, batch = args.seq_len, args.batch
    data = np.fromfile(args.data, dtype=np.int64)[: args.steps * world * 2 * batch * seq]
    data = data.reshape(args.steps, world, 2, batch, seq)
    for step in range(args.steps):
        mark(f"step {step + 1}")
        t0 = time.monotonic()
        lr = lr_at(optim_cfg, step, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = (torch.from_numpy(data[step, rank, k].copy()) for k in (0, 1))
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if optim_cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        record(f"step {step + 1}", t0, lr=lr, _local=[loss.item()])
    mark("done")
    if out is not None:
        out.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
