#!/usr/bin/env python3
"""Writes a Hugging Face model directory of a published config with random bf16 weights, one
safetensors file at a time: no process ever holds the whole model (an 8B model is 16 GB of bf16).

The tensor names and shapes come from transformers' model built on the meta device (no memory), so
every family transformers knows is written as save_pretrained would name it. Values: a normal of
std initializer_range per matrix (seeded per tensor by its index, so a file's values do not depend
on which other files exist), ones for norm weights, zeros for biases. Files are filled in the
model's order up to --shard-mb each (a tensor larger than that gets a file of its own), with
model.safetensors.index.json and config.json beside them.

With --bnb-4bit the directory is a bitsandbytes 4-bit NF4 save as transformers writes one
(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)):
every Linear weight of the decoder layers becomes random NF4 codes (uniform bytes) with
double-quantized absmax (U8 codes over a 256-level map, an fp32 absmax per 256 blocks and an offset,
chosen so the absmax lie in 0.05-0.07, values of a std near 0.03), its quant_map NF4's levels and
its quant_state JSON; the embedding, the head and the norms stay bf16; config.json gets the
quantization_config. A 70B model is then about 40 GB, written without bitsandbytes.

Usage: bench/write_model.py --model llama-3.1-70b|llama-3.1-8b|llama-3.2-1b|qwen2.5-0.5b|tiny OUT
           [--shard-mb 250] [--layers N] [--seed S] [--bnb-4bit]
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


NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0]
QUANTIZED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
             "up_proj.weight", "down_proj.weight")


def bnb_4bit(name, shape, index, seed):
    """The tensors of one quantized Linear weight, as a bnb-4bit save names them."""
    import numpy as np
    import torch
    n = 1
    for d in shape:
        n *= d
    blocks = (n + 63) // 64
    rng = np.random.default_rng(seed * 1_000_003 + index)
    codes = torch.frombuffer(bytearray(rng.bytes((n + 1) // 2)), dtype=torch.uint8).view(-1, 1)
    absmax = torch.frombuffer(bytearray(rng.bytes(blocks)), dtype=torch.uint8)
    offset = 0.06
    state = {"quant_type": "nf4", "absmax_dtype": "float32", "blocksize": 64, "dtype": "bfloat16",
             "shape": list(shape), "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": offset}
    text = json.dumps(state).encode()
    return {
        name: codes,
        name + ".absmax": absmax,
        name + ".nested_absmax": torch.full(((blocks + 255) // 256,), 0.01, dtype=torch.float32),
        name + ".nested_quant_map": torch.linspace(-1, 1, 256, dtype=torch.float32),
        name + ".quant_map": torch.tensor(NF4_LEVELS, dtype=torch.float32),
        name + ".quant_state.bitsandbytes__nf4": torch.frombuffer(bytearray(text), dtype=torch.uint8),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), required=True)
    ap.add_argument("out")
    ap.add_argument("--shard-mb", type=int, default=250)
    ap.add_argument("--layers", type=int, default=0, help="truncate to this many decoder layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bnb-4bit", action="store_true", help="a bitsandbytes 4-bit NF4 save with random codes")
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
    quantized = (lambda name: args.bnb_4bit and name.endswith(QUANTIZED))
    for i, (name, shape) in enumerate(tensors):
        n = 2 if not quantized(name) else 0.53  # bytes per value: bf16, or NF4 codes and absmax
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
        data = {}
        for i, name, shape in group:
            if quantized(name):
                data.update(bnb_4bit(name, shape, i, args.seed))
            else:
                data[name] = values(name, shape, i, std, args.seed)
        save_file(data, os.path.join(args.out, fname), metadata={"format": "pt"})
        for name in data:
            weight_map[name] = fname
        total += sum(t.numel() * t.element_size() for t in data.values())
        del data
        print(f"write_model: {fname} ({total / 2**30:.2f} GiB, {time.time() - t0:.0f} s)", flush=True)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(args.out)
    if args.bnb_4bit:
        path = os.path.join(args.out, "config.json")
        with open(path) as f:
            doc = json.load(f)
        doc["quantization_config"] = {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": None}
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
    print(f"write_model: {args.out}: {len(tensors)} tensors, {len(groups)} files, {total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
