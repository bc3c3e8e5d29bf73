#!/usr/bin/env python3
"""Writes a Hugging Face model directory of a published config with random bf16 weights, one
safetensors file at a time: no process ever holds the whole model (an 8B model is 16 GB of bf16).

The tensor names and shapes come from transformers' model built on the meta device (no memory), so
every family transformers knows is written as save_pretrained would name it. Values: a normal of
std initializer_range per matrix (seeded per tensor by its index, so a file's values do not depend
on which other files exist), ones for norm weights, zeros for biases. Files are filled in the
model's order up to --shard-mb each (a tensor larger than that gets a file of its own), with
model.safetensors.index.json and config.json beside them.

Usage: bench/write_model.py --model llama-3.1-8b|llama-3.2-1b|qwen2.5-0.5b|tiny OUT [--shard-mb 250]
           [--layers N] [--seed S]
       (the venv's python; --layers truncates the config, e.g. for a logits check at 8B)
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_common import CONFIGS  # noqa: E402,F401  (bench/vs_peft.py takes them from here)


def tensor_list(spec):
    """(name, shape) of every tensor save_pretrained would write, in the model's order."""
    import torch
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(**spec)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if spec.get("tie_word_embeddings") and name == "lm_head.weight":
            continue  # tied: saved once, under the embedding's name
        out.append((name, tuple(t.shape)))
    return config, out


def values(name, shape, index, std, seed):
    import torch
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std).to(torch.bfloat16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), required=True)
    ap.add_argument("out")
    ap.add_argument("--shard-mb", type=int, default=250)
    ap.add_argument("--layers", type=int, default=0, help="truncate to this many decoder layers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from safetensors.torch import save_file
    spec = dict(CONFIGS[args.model])
    if args.layers:
        spec["num_hidden_layers"] = args.layers
        if "max_window_layers" in spec:
            spec["max_window_layers"] = min(spec["max_window_layers"], args.layers)
    os.makedirs(args.out, exist_ok=True)
    config, tensors = tensor_list(spec)
    limit = args.shard_mb * 10**6
    groups, cur, size = [], [], 0
    for i, (name, shape) in enumerate(tensors):
        n = 2
        for d in shape:
            n *= d
        if cur and size + n > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append((i, name, shape))
        size += n
    if cur:
        groups.append(cur)
    weight_map, total, t0 = {}, 0, time.time()
    std = spec.get("initializer_range", 0.02)
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {name: values(name, shape, i, std, args.seed) for i, name, shape in group}
        save_file(data, os.path.join(args.out, fname), metadata={"format": "pt"})
        for _, name, _ in group:
            weight_map[name] = fname
        total += sum(t.numel() * 2 for t in data.values())
        del data
        print(f"write_model: {fname} ({total / 2**30:.2f} GiB, {time.time() - t0:.0f} s)", flush=True)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(args.out)
    print(f"write_model: {args.out}: {len(tensors)} tensors, {len(groups)} files, {total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
