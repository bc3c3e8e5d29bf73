#!/usr/bin/env python3
"""scripts/dcp-import: a PyTorch FSDP2 run's DCP checkpoint continued by fsdp-train; one case per run:

Resume    PyTorch FSDP2 (transformers' LlamaForCausalLM, fully_shard on each layer and the root,
          fused AdamW in fsdp's two groups, fsdp-train's schedule and clipping: bench/compare_fsdp2.py's
          setup) trains a tiny Llama on 2 CPU ranks over Gloo for 3 steps from fsdp-train's step-0
          weights, on fsdp-train's own batches of a byte file, saves model and optimizer with
          dcp.save(get_state_dict(...)) and runs steps 4 and 5. scripts/dcp-import converts the
          checkpoint; fsdp-train resumes it on 2 ranks and runs steps 4 and 5: both losses equal
          FSDP2's within bench/compare.py's fair-comparison tolerance (1e-4 absolute; step 5's
          depends on the converted AdamW moments and step count), train_state.json holds step 3
          and samples_seen 12, and fsdp-ckpt logits of the converted checkpoint equal the FSDP2
          model's logits at the save within 1e-4.
BadInput  DCP checkpoints of the same model saved by one process, with a tensor renamed, a tensor
          of another shape, an exp_avg of another shape and an SGD momentum: each is refused
          (status 1) naming the tensor, and nothing is left in the output directory.

Usage: FSDP_RUN=... FSDP_TRAIN=... FSDP_CKPT=... dcp_import_test.py CASE    (the venv's python; ctest
sets them; "N passed, M failed"). The FSDP2 ranks run this file as `fsdp2-worker` under torchrun.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "support"))
from hf_checks import record, run, summary  # noqa: E402

LOSS_TOL = 1e-4     # bench/compare.py's LOSS_TOL: fsdp against FSDP2 on the same work
LOGITS_ATOL = 1e-4  # fp32, the same math in two implementations
SAVE_AT, STEPS, WORLD, BATCH, SEQ = 3, 5, 2, 2, 32
CONFIG = {
    "model": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "data": {"source": "file", "seq_len": SEQ, "batch_size_per_rank": BATCH},
    "optim": {"warmup_steps": 2, "lr": 3e-3, "min_lr": 3e-4},
    "train": {"steps": STEPS, "eval_every": 0, "log_every": 1, "seed": 11},
}
DATA_BYTES = 6000


# ---- fsdp-train's data stream (apps/fsdp-train/data.cpp: FileSource, sample_key, SampleRng)

def mix64(x):
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def batch_of(tokens, seed, step, rank):
    """Rank `rank`'s (inputs, targets) of fsdp-train's step `step` (from 0) over a raw byte file."""
    window = SEQ + 1
    count = len(tokens)
    train_len = count - max(window, count // 10)  # the last 10% held out for eval
    rows = []
    for k in range(step * WORLD * BATCH + rank * BATCH, step * WORLD * BATCH + (rank + 1) * BATCH):
        key = mix64(mix64(mix64(seed) ^ 0) ^ k)  # split 0: train
        start = mix64(key) % (train_len - window + 1)
        rows.append(tokens[start:start + window])
    w = torch.tensor(np.stack(rows), dtype=torch.int64)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def lr_at(optim_cfg, step, total_steps):
    """fsdp-train's schedule (as bench/compare_fsdp2.py): linear warmup, then cosine to min_lr."""
    lr, warmup = optim_cfg["lr"], optim_cfg["warmup_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total_steps - warmup))
    return optim_cfg["min_lr"] + 0.5 * (lr - optim_cfg["min_lr"]) * (1.0 + math.cos(math.pi * progress))


# ---- the FSDP2 side, one process per rank under torchrun

def fsdp2_worker(hf_dir, ckpt, data_path, dcp_dir, tokens_path, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = json.load(open(os.path.join(ckpt, "train_state.json")))["extra"]["config"]
    o = cfg["optim"]
    config = LlamaConfig.from_pretrained(hf_dir, attn_implementation=cfg["model"]["attn_implementation"],
                                         use_cache=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(load_file(os.path.join(hf_dir, "model.safetensors")), strict=False)
    assert not [m for m in missing if not m.endswith("inv_freq")] and not unexpected, (missing, unexpected)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=True)
    tokens = np.fromfile(data_path, dtype=np.uint8).astype(np.int64)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_dir)
            with torch.no_grad():
                logits = model(input_ids=torch.from_numpy(np.load(tokens_path)), use_cache=False).logits
            if rank == 0:
                np.save(os.path.join(out_dir, "fsdp2_logits.npy"), logits.float().numpy())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(o, step, STEPS)
        inputs, targets = batch_of(tokens, cfg["train"]["seed"], step, rank)
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if o["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        json.dump({"losses": losses}, open(os.path.join(out_dir, "fsdp2.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


# ---- the cases

def dcp_import(*args):
    return run([sys.executable, os.path.join(ROOT, "scripts", "dcp-import"), *args], timeout=240)


def write_inputs(tmp):
    data = os.path.join(tmp, "data.txt")
    np.random.default_rng(5).integers(0, 256, DATA_BYTES, dtype=np.uint8).tofile(data)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = data
    path = os.path.join(tmp, "run.json")
    json.dump(cfg, open(path, "w"))
    return data, path


def metrics_losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if "loss" in j and not j.get("eval")}


def case_resume(programs, tmp):
    data, cfg = write_inputs(tmp)
    init = os.path.join(tmp, "init")
    rc, log = run([programs["FSDP_TRAIN"], "--config", cfg, "--steps", "0", "--save-dir", init])
    record(f"fsdp-train step-0 checkpoint (status {rc})", rc == 0, log)
    rc, log = run([programs["FSDP_CKPT"], "export", init, os.path.join(tmp, "hf")])
    record(f"fsdp-ckpt export (status {rc})", rc == 0, log)
    tokens = os.path.join(tmp, "tokens.npy")
    np.save(tokens, np.random.default_rng(6).integers(0, 256, (2, 24)).astype(np.int64))
    dcp_dir = os.path.join(tmp, "dcp")
    rc, log = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                   os.path.abspath(__file__), "fsdp2-worker", os.path.join(tmp, "hf"),
                   os.path.join(init, "step-00000000"), data, dcp_dir, tokens, tmp], timeout=240)
    record(f"FSDP2 on {WORLD} ranks trains, saves with dcp.save at step {SAVE_AT}, goes on (status {rc})", rc == 0, log)
    if rc != 0:
        return
    record("dcp.save wrote one .distcp file per rank", sorted(f for f in os.listdir(dcp_dir) if f.endswith(".distcp"))
           == ["__0_0.distcp", "__1_0.distcp"], os.listdir(dcp_dir))
    out = os.path.join(tmp, "converted")
    rc, log = dcp_import(dcp_dir, out, "--config", cfg)
    record(f"dcp-import (status {rc})", rc == 0, log)
    if rc != 0:
        return
    print(log.strip().splitlines()[-1])
    name = open(os.path.join(out, "latest")).read().strip()
    state = json.load(open(os.path.join(out, name, "train_state.json")))
    record(f"converted: {name}, step {state['step']}, samples_seen {state['samples_seen']}, world_size "
           f"{state['world_size']}", name == f"step-{SAVE_AT:08d}" and state["step"] == SAVE_AT and
           state["samples_seen"] == SAVE_AT * WORLD * BATCH and state["world_size"] == WORLD, state)
    steps = set(state["optimizer"]["steps"].values())
    record(f"converted AdamW step counts {sorted(steps)}", steps == {SAVE_AT}, state["optimizer"])
    rc, log = run([programs["FSDP_CKPT"], "verify", out])
    record(f"fsdp-ckpt verify of the converted checkpoint (status {rc})", rc == 0 and log.startswith("ok: "), log)
    metrics = os.path.join(tmp, "resumed.jsonl")
    rc, log = run([programs["FSDP_RUN"], "--nproc-per-node", str(WORLD), "--timeout-s", "120", "--",
                   programs["FSDP_TRAIN"], "--config", cfg, "--save-dir", out, "--resume", "latest",
                   "--metrics", metrics], timeout=180)
    record(f"fsdp-train resumes the converted checkpoint on {WORLD} ranks (status {rc})",
           rc == 0 and f"resumed from {os.path.join(out, name)} at step {SAVE_AT}" in log, log)
    if rc != 0:
        return
    ours = metrics_losses(metrics)
    theirs = json.load(open(os.path.join(tmp, "fsdp2.json")))["losses"]
    for step in range(SAVE_AT + 1, STEPS + 1):
        a, b = ours.get(step), theirs[step - 1]
        ok = a is not None and abs(a - b) <= LOSS_TOL
        record(f"step {step}: fsdp-train loss {a} vs FSDP2 {b:.6f} (|diff| "
               f"{abs(a - b) if a is not None else float('nan'):.2e}, tolerance {LOSS_TOL:g})", ok, ours)
    check_logits(programs, tmp, os.path.join(out, name), tokens)


def check_logits(programs, tmp, ckpt, tokens):
    path = os.path.join(tmp, "fsdp_logits.npy")
    rc, log = run([programs["FSDP_CKPT"], "logits", ckpt, tokens, path])
    record(f"fsdp-ckpt logits of the converted checkpoint (status {rc})", rc == 0, log)
    if rc != 0:
        return
    ours, theirs = np.load(path), np.load(os.path.join(tmp, "fsdp2_logits.npy"))
    diff = float(np.abs(ours - theirs).max()) if ours.shape == theirs.shape else float("inf")
    scale = float(np.abs(theirs).max())
    record(f"logits {list(ours.shape)} equal the FSDP2 model's at the save within {LOGITS_ATOL} (max abs diff "
           f"{diff:.2e}, max |logit| {scale:.3f})", diff <= LOGITS_ATOL and scale > 100 * LOGITS_ATOL)


def save_bad_dcp(path, change):
    """One process: a DCP checkpoint of the test's model after one AdamW step, changed by `change`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    m = CONFIG["model"]
    config = LlamaConfig(**m, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, m["vocab_size"], (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": dict(model_sd), "optim": optim_sd}
    change(sd)
    dcp.save(sd, checkpoint_id=path, no_dist=True)


def rename(sd):
    sd["model"]["model.layers.1.self_attn.qproj.weight"] = sd["model"].pop("model.layers.1.self_attn.q_proj.weight")


def reshape(sd):
    sd["model"]["model.layers.0.mlp.up_proj.weight"] = sd["model"]["model.layers.0.mlp.up_proj.weight"][:-1].clone()


def reshape_moment(sd):
    entry = sd["optim"]["state"]["model.norm.weight"]
    entry["exp_avg"] = entry["exp_avg"][:-2].clone()


def sgd_state(sd):
    for entry in sd["optim"]["state"].values():
        entry["momentum_buffer"] = entry.pop("exp_avg_sq")


def case_bad_input(programs, tmp):
    _, cfg = write_inputs(tmp)
    os.environ["FSDP_TRAIN"] = programs["FSDP_TRAIN"]
    cases = [
        ("a renamed tensor", rename, ["'model.layers.1.self_attn.qproj.weight' [64, 64]: fsdp's model has no tensor",
                                      "'model.layers.1.self_attn.q_proj.weight' [64, 64]: fsdp's model has it"]),
        ("a tensor of another shape", reshape, ["tensor 'model.layers.0.mlp.up_proj.weight' has shape [159, 64] but "
                                                "fsdp's model has [160, 64]"]),
        ("an exp_avg of another shape", reshape_moment, ["optimizer state 'exp_avg' of 'model.norm.weight' has shape "
                                                         "[62] but the tensor has [64]"]),
        ("SGD's momentum", sgd_state, ["optimizer state 'momentum_buffer' of 'model.embed_tokens.weight' is not "
                                       "AdamW's"]),
    ]
    for label, change, wants in cases:
        dcp_dir = os.path.join(tmp, label.replace(" ", "_"))
        save_bad_dcp(dcp_dir, change)
        out = os.path.join(tmp, "out_" + label.replace(" ", "_"))
        rc, log = dcp_import(dcp_dir, out, "--config", cfg)
        ok = rc == 1 and all(w in log for w in wants) and not os.path.exists(out)
        record(f"{label}: refused with status {rc}, naming it, nothing written", ok, log)


def main():
    if len(sys.argv) == 8 and sys.argv[1] == "fsdp2-worker":
        fsdp2_worker(*sys.argv[2:])
        return 0
    cases = {"Resume": case_resume, "BadInput": case_bad_input}
    if len(sys.argv) != 2 or sys.argv[1] not in cases:
        print(f"usage: dcp_import_test.py {'|'.join(cases)}", file=sys.stderr)
        return 2
    programs = {k: os.environ[k] for k in ("FSDP_RUN", "FSDP_TRAIN", "FSDP_CKPT")}
    tmp = tempfile.mkdtemp(prefix="fsdp-dcp-import-")
    os.environ["TMPDIR"] = tmp  # what the programs leave in a temporary folder (torchrun's logs) goes too
    try:
        cases[sys.argv[1]](programs, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
