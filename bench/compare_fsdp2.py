"""The PyTorch FSDP2 side of `scripts/bench compare`.

Trains Hugging Face's LlamaForCausalLM, built from the config.json that `fsdp-ckpt export` wrote
for fsdp-train's step-0 checkpoint and loaded with those same initial weights, with FSDP2 in its
stock configuration as its documentation recommends: `fully_shard` on every decoder layer, then on
the root, reshard_after_forward left at its default; CPU over Gloo. The batches come from
`bench_unsharded --dump-data` (fsdp-train's own data stream), the optimizer settings and LR
schedule from the checkpoint's train_state.json, so the three systems of the comparison do the
same work:
- torch.optim.AdamW(fused=True) (the fused CPU kernel rather than the default per-parameter
  loop), in fsdp's two parameter groups: weight decay on parameters of 2 or more dimensions, none
  on 1-D ones (norm weights, biases);
- attn_implementation as fsdp-train's model.attn_implementation in the checkpoint ("sdpa" by
  default, "eager" when set so; a checkpoint from before that key was eager), so both sides run
  the same attention kind; use_cache=False (training keeps no KV cache).
Writes fsdp-train's --metrics line format (rank 0).

Launch one process per rank (fsdp-run or torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
  fsdp-run --nproc-per-node 2 -- python bench/compare_fsdp2.py --hf HF_DIR --checkpoint CKPT \
      --data batches.bin --data-world 2 --steps 10 --threads 1 --metrics out.jsonl
With --init-only it imports everything, joins the process group, builds the device mesh and
writes one line {"init_only": true, "peak_rss_bytes": [per rank]}, without building the model:
the process's own memory baseline.

Communication is measured by wrapping the torch.distributed collectives FSDP2 calls
(all_gather_into_tensor, reduce_scatter_tensor, all_reduce) and Work.wait:
- bytes: what a bandwidth-optimal ring sends per rank for the sizes FSDP2 passes, (N-1)/N of the
  gathered or reduced buffer (2(N-1)/N for all_reduce); Gloo's own algorithms may send more.
- blocked time: each interval in which the training thread blocks on communication, counted once:
  the wall time of a synchronous call (the Work.wait it makes inside is not counted again), and
  the time in Work.wait of an asynchronous one. The functional collectives of DTensor's
  clip_grad_norm_ do not pass through either, so FSDP2's clipping all-reduce is not counted (fsdp's
  is): a small advantage to FSDP2.
"""
import argparse
import datetime
import inspect
import json
import math
import os
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


class CommMeter:
    """Counts bytes and blocked time of the collectives issued while enabled."""

    def __init__(self):
        self.allgather_bytes = 0.0
        self.reduce_scatter_bytes = 0.0
        self.allreduce_bytes = 0.0
        self.wait_s = 0.0
        self.enabled = False
        self.in_sync_call = 0  # > 0 inside a synchronous collective: its wall time is the blocked time

    def install(self):
        meter = self

        def group_size(group):
            return dist.get_world_size(group) if group is not None else dist.get_world_size()

        def nbytes(t):
            return t.numel() * t.element_size()

        def wrap(fn, kind):
            sig = inspect.signature(fn)

            def wrapped(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                group, async_op = a.get("group"), a.get("async_op", False)
                t0 = time.perf_counter()
                if not async_op:
                    meter.in_sync_call += 1
                try:
                    work = fn(*args, **kwargs)
                finally:
                    if not async_op:
                        meter.in_sync_call -= 1
                dt = time.perf_counter() - t0
                if meter.enabled:
                    n = group_size(group)
                    if kind == "ag":
                        meter.allgather_bytes += nbytes(a["output_tensor"]) * (n - 1) / n
                    elif kind == "rs":
                        meter.reduce_scatter_bytes += nbytes(a["input"]) * (n - 1) / n
                    else:
                        meter.allreduce_bytes += nbytes(a["tensor"]) * 2 * (n - 1) / n
                    if not async_op:
                        meter.wait_s += dt
                return work

            return wrapped

        dist.all_gather_into_tensor = wrap(dist.all_gather_into_tensor, "ag")
        dist.reduce_scatter_tensor = wrap(dist.reduce_scatter_tensor, "rs")
        dist.all_reduce = wrap(dist.all_reduce, "ar")
        orig_wait = dist.Work.wait

        def timed_wait(work, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig_wait(work, *args, **kwargs)
            finally:
                # Inside a synchronous call the call's own wall time already covers this wait.
                if meter.enabled and meter.in_sync_call == 0:
                    meter.wait_s += time.perf_counter() - t0

        dist.Work.wait = timed_wait

    def snapshot(self):
        return (self.allgather_bytes, self.reduce_scatter_bytes, self.wait_s)


def lr_at(optim_cfg, step, total_steps):
    """fsdp-train's schedule: linear warmup, then cosine to min_lr (or constant)."""
    lr, warmup = optim_cfg["lr"], optim_cfg["warmup_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    if optim_cfg["schedule"] == "constant" or total_steps <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / (total_steps - warmup))
    min_lr = optim_cfg["min_lr"]
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def init_process_group(timeout_s=300):
    """Gloo from the torchrun-style environment. Under fsdp-run, rank 0 hosts the store on the
    socket the launcher holds for MASTER_PORT (FSDP_MASTER_LISTEN_FD; binding the port anew would
    find it in use). Every rank then passes its store explicitly: init_process_group prefixes a
    store it makes itself ("default_pg") but not one it is given, so a mix of the two never meets."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_RUN_ID") != "fsdp-run":  # torchrun and the like
        dist.init_process_group("gloo", timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fd = os.environ.get("FSDP_MASTER_LISTEN_FD")
    if rank == 0 and fd is None:
        raise SystemExit("compare_fsdp2: under fsdp-run rank 0 needs FSDP_MASTER_LISTEN_FD (the held MASTER_PORT); "
                         "run it with --master-port P if the launcher was told not to hold it")
    if rank == 0:
        store = dist.TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=int(fd))
    else:
        store = dist.TCPStore(host, port, world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="directory written by fsdp-ckpt export")
    ap.add_argument("--checkpoint", required=True, help="the fsdp checkpoint it was exported from (for the config)")
    ap.add_argument("--data", required=True, help="batches written by bench_unsharded --dump-data")
    ap.add_argument("--data-world", type=int, required=True, help="the --world the batches were dumped for")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--metrics", default="")
    ap.add_argument("--init-only", action="store_true",
                    help="stop after imports, the process group and the mesh: report peak RSS, build no model")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    meter = CommMeter()
    meter.install()  # before FSDP2 issues anything
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.data_world:
        raise SystemExit(f"compare_fsdp2: --data was dumped for {args.data_world} ranks, running on {world}")

    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world,))
    if args.init_only:
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, torch.tensor([float(peak_rss_bytes())], dtype=torch.float64))
        if args.metrics and rank == 0:
            with open(args.metrics, "w") as f:
                f.write(json.dumps({"init_only": True, "peak_rss_bytes": [t.item() for t in every]}) + "\n")
        dist.destroy_process_group()
        return

    with open(os.path.join(args.checkpoint, "train_state.json")) as f:
        cfg = json.load(f)["extra"]["config"]
    optim_cfg, data_cfg = cfg["optim"], cfg["data"]
    batch, seq = data_cfg["batch_size_per_rank"], data_cfg["seq_len"]

    # The attention kind fsdp-train ran (model.attn_implementation; absent before it existed, when
    # fsdp's attention was eager). The exported config.json is for inference (use_cache true);
    # training keeps no KV cache.
    attn = cfg["model"].get("attn_implementation", "eager")
    config = LlamaConfig.from_pretrained(args.hf, attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    if model.config._attn_implementation != attn or model.config.use_cache:
        raise SystemExit(f"compare_fsdp2: model built with attn_implementation={model.config._attn_implementation}, "
                         f"use_cache={model.config.use_cache}; expected {attn}, False")
    missing, unexpected = model.load_state_dict(load_file(os.path.join(args.hf, "model.safetensors")), strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise SystemExit(f"compare_fsdp2: weights do not match the model: missing {missing}, unexpected {unexpected}")
    model.train()

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fsdp's groups (fsdp::default_param_group): decay on >= 2-D parameters, none on 1-D ones. A
    # DTensor's ndim is the full parameter's.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": optim_cfg["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=optim_cfg["lr"], betas=tuple(optim_cfg["betas"]), eps=optim_cfg["eps"],
                                  fused=True)

    # [steps, world, 2, batch, seq] int64
    data = np.fromfile(args.data, dtype=np.int64)
    if data.size < args.steps * world * 2 * batch * seq:
        raise SystemExit(f"compare_fsdp2: {args.data} holds fewer than {args.steps} steps of data")
    data = data[: args.steps * world * 2 * batch * seq].reshape(args.steps, world, 2, batch, seq)

    out = open(args.metrics, "w") if (args.metrics and rank == 0) else None
    for step in range(args.steps):
        t0 = time.perf_counter()
        lr = lr_at(optim_cfg, step, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs = torch.from_numpy(data[step, rank, 0].copy())
        targets = torch.from_numpy(data[step, rank, 1].copy())
        meter.enabled = True
        before = meter.snapshot()
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if optim_cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        after = meter.snapshot()
        meter.enabled = False
        # Every rank's counters to rank 0 in one all_gather, as fsdp-train does.
        mine = torch.tensor([loss.item(), after[0] - before[0], after[1] - before[1], after[2] - before[2],
                             float(peak_rss_bytes())], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        dt = time.perf_counter() - t0
        if out is not None:
            ranks = torch.stack(every).tolist()
            line = {"step": step + 1, "loss": sum(r[0] for r in ranks) / world, "lr": lr, "step_time_s": dt,
                    "tokens_per_s": batch * world * seq / dt,
                    "allgather_bytes": [r[1] for r in ranks], "reduce_scatter_bytes": [r[2] for r in ranks],
                    "comm_wait_s": [r[3] for r in ranks], "peak_rss_bytes": [r[4] for r in ranks]}
            out.write(json.dumps(line) + "\n")
            out.flush()
    if out is not None:
        out.close()
    # Every rank leaves together: a rank tearing down the group while another still uses the store
    # it hosts can abort the other at exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
