#!/usr/bin/env python3
"""LoRA on 2 ranks against peft: fsdp-train's losses with a bf16 base against an unsharded
reference built with peft and transformers on the same weights, batches and adapter initialisation.

1. peft makes the starting adapter from the base (`--hf`, a Hugging Face directory in bf16), with
   init_lora_weights=False so that lora_B is not zero and the first steps already train through it,
   and saves it (adapter0/).
2. fsdp-train runs on 2 ranks through fsdp-run: --init-from the base, the lora section with
   base_dtype bfloat16 (the frozen base kept in bf16, no fp32 master) and adapter_from adapter0,
   fp32 compute, AdamW, grad clipping, the warmup-cosine schedule.
3. bench_unsharded --dump-data writes the batches fsdp-train's ranks trained on.
4. The reference: transformers' model of the base in fp32 (the bf16 values, exactly), peft's
   PeftModel.from_pretrained(adapter0, is_trainable=True), torch.optim.AdamW over the adapters with
   fsdp-train's settings (weight decay on the 2-D adapters), clip_grad_norm_ over them, the same LR
   at each step, each step on both ranks' batches together (the same mean as fsdp's two ranks).

Prints both losses per step and exits 1 when any differs by more than --tol (default 1e-4).

Usage: .venv/bin/python bench/lora_parity.py --hf DIR --bin build/bin --work DIR [--steps 5]
       [--seq-len 32] [--batch 2] [--r 8] [--alpha 16] [--threads 1] [--tol 1e-4] [--json OUT]
"""
import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_fsdp2 import lr_at  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIM = {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 2,
         "schedule": "cosine", "min_lr": 2e-4, "grad_clip": 1.0}


def make_adapter(hf, out, r, alpha, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0,
                                            init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(out)


def train_flags(args, adapter):
    o = OPTIM
    sets = {"data.seq_len": args.seq_len, "data.batch_size_per_rank": args.batch, "train.eval_every": 0,
            "train.log_every": 1, "optim.lr": o["lr"], "optim.betas": json.dumps(o["betas"]), "optim.eps": o["eps"],
            "optim.weight_decay": o["weight_decay"], "optim.warmup_steps": o["warmup_steps"],
            "optim.schedule": o["schedule"], "optim.min_lr": o["min_lr"], "optim.grad_clip": o["grad_clip"],
            "lora.r": args.r, "lora.alpha": args.alpha, "lora.base_dtype": "bfloat16", "lora.adapter_from": adapter}
    flags = ["--init-from", args.hf, "--steps", str(args.steps)]
    for k, v in sets.items():
        flags += ["--set", f"{k}={v}"]
    return flags


def reference_losses(args, adapter, batches):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    o = OPTIM
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
    losses = []
    for step in range(args.steps):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(o, step, args.steps)
        inputs = torch.from_numpy(np.concatenate([batches[step, r, 0] for r in range(2)]))
        targets = torch.from_numpy(np.concatenate([batches[step, r, 1] for r in range(2)]))
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--bin", required=True, help="the build's bin directory (fsdp-run, fsdp-train, bench_unsharded)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    adapter = os.path.join(args.work, "adapter0")
    make_adapter(args.hf, adapter, args.r, args.alpha, seed=1)

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    metrics = os.path.join(args.work, "fsdp.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    flags = train_flags(args, adapter)
    subprocess.run([os.path.join(args.bin, "fsdp-run"), "--nproc-per-node", "2", "--timeout-s", "600", "--",
                    os.path.join(args.bin, "fsdp-train"), *flags, "--metrics", metrics], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    fsdp = [json.loads(line)["loss"] for line in open(metrics) if '"eval' not in line]

    data = os.path.join(args.work, "batches.bin")
    subprocess.run([os.path.join(args.bin, "bench_unsharded"), *flags, "--dump-data", data, "--world", "2"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    batches = np.fromfile(data, dtype=np.int64).reshape(args.steps, 2, 2, args.batch, args.seq_len)
    ref = reference_losses(args, adapter, batches)

    worst = max(abs(a - b) for a, b in zip(fsdp, ref))
    print(f"LoRA r={args.r} alpha={args.alpha}, base bf16 (fsdp: frozen bf16 shards, no fp32 master), fp32 compute,"
          f" 2 ranks, {args.steps} steps of {2 * args.batch} x {args.seq_len} tokens")
    print("step  fsdp-train          peft+transformers   |diff|")
    for i, (a, b) in enumerate(zip(fsdp, ref)):
        print(f"{i + 1:>4}  {a:.10f}  {b:.10f}  {abs(a - b):.2e}")
    ok = len(fsdp) == args.steps and worst <= args.tol
    print(f"max |diff| {worst:.2e} (tolerance {args.tol:g}): {'ok' if ok else 'FAILED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fsdp": fsdp, "reference": ref, "max_abs_diff": worst, "tol": args.tol, "ok": ok}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
