#!/usr/bin/env python3
"""A bitsandbytes 4-bit checkpoint imported as it is (Note [bitsandbytes 4-bit weights] in
src/bnb/bnb4.cpp), against bitsandbytes and transformers, on a small llama (2 layers) quantized
here by bitsandbytes on the CPU (NF4, blocks of 64, double-quantized absmax):
  - bnb_import_tool (fsdp's QLoRA model on one rank, the base in NF4) imports the save: each NF4
    weight's stored codes equal bitsandbytes' bytes, its absmax bitsandbytes' decoded absmax, and
    its values decoded by fsdp's codec bitsandbytes' dequantize_4bit, in fp32 and in bf16, bit for
    bit; its logits (fp32 compute) equal those of transformers in fp32 on bitsandbytes' dequantized
    weights within EXACT_TOL x max |logit|, and those of transformers running the quantized model
    (bitsandbytes' CPU Linear4bit) within BNB_TOL x max |logit|; so too with a random peft adapter
    on both sides;
  - fsdp-ckpt logits of the save (import_unsharded, the values decoded) equal the latter's;
  - fsdp-train --init-from the save with lora.base_dtype=nf4 trains; from a save without double
    quantization (an fp32 absmax) its losses equal, bitwise, those of the same run from the bf16
    weights the save was made from (fsdp's own NF4 encode of them is the same stored form);
  - with the base in the disk tier, its NF4 codes read in place from the save's files: the same
    losses as in memory and as with a copy of the codes in the tier, a fraction of that copy's disk,
    and a save of the base equal to the run in memory's (check_in_place);
  - clear errors naming the tensor and the setting for FP4, another blocksize, 8-bit weights and a
    malformed quant_state.

Usage: FSDP_RUN=... FSDP_TRAIN=... FSDP_CKPT=... bnb_import_test.py PATH/TO/bnb_import_tool (the venv's python;
ctest sets the variables; prints "N passed, M failed")
"""
import json
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "support"))
import bnb_checks as bc  # noqa: E402
from hf_checks import record, run, summary  # noqa: E402

# Against transformers in fp32 on bitsandbytes' dequantized weights: the same fp32 arithmetic on the
# same values, only the order of the sums may differ (measured: 0). Against transformers running
# bitsandbytes' CPU Linear4bit: its product is not fp32's (measured 0.9% of max |logit|), so the
# tolerance for a side that computes in bf16 (bench/results' 2^-5 x max |logit|).
EXACT_TOL = 1e-5
BNB_TOL = 0.03125
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TRAIN = ["--set", "data.seq_len=16", "--set", "data.batch_size_per_rank=2", "--set", "train.eval_every=0",
         "--set", "optim.warmup_steps=1", "--set", "lora.enabled=true", "--set", "lora.r=4",
         "--set", "lora.base_dtype=nf4", "--steps", "3"]


def check_parity(tool, q, work):
    tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], 24)
    adapter = bc.random_adapter(os.path.join(work, "bf16"), os.path.join(work, "adapter"), r=4, alpha=8)
    for label, extra in (("base", None), ("base + peft adapter", adapter)):
        rc, out, doc, data = bc.run_tool(tool, q, tokens, os.path.join(work, "tool"), r=4, alpha=8.0, adapter=extra)
        record(f"{label}: bnb_import_tool imports the bnb-4bit save", rc == 0, out)
        if rc != 0:
            continue
        quant = bc.load_quantized(q, extra)
        if extra is None:
            bad, n = bc.compare_weights(doc, data, bc.bnb_reference(quant, q))
            record(f"{n} NF4 weights: codes, absmax and decoded values (fp32, bf16) equal bitsandbytes'",
                   n == 14 and not bad, "\n".join(bad) or f"{n} weights")
        ours = bc.tool_logits(doc, data)
        exact = bc.logits_of(bc.dequantized_model(q, extra), tokens)
        for what, theirs, tol in (("transformers fp32 on bitsandbytes' dequantized weights", exact, EXACT_TOL),
                                  ("transformers + bitsandbytes' CPU Linear4bit", bc.logits_of(quant, tokens), BNB_TOL)):
            diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
            record(f"{label}: logits within {tol} x max |logit| of {what} "
                   f"(max diff {diff:.3g}, max |logit| {scale:.3g})", diff <= tol * max(1.0, scale))
        if extra is None:  # import_unsharded: the same values decoded into an ordinary module
            np.save(os.path.join(work, "tokens.npy"), tokens.reshape(1, -1).astype(np.int64))
            rc, out = run([os.environ["FSDP_CKPT"], "logits", q, os.path.join(work, "tokens.npy"),
                           os.path.join(work, "ckpt.npy")])
            diff = float(np.abs(np.load(os.path.join(work, "ckpt.npy"))[0] - exact).max()) if rc == 0 else None
            record(f"fsdp-ckpt logits of the bnb-4bit save (import_unsharded) equal transformers' on bitsandbytes' "
                   f"dequantized weights within {EXACT_TOL} x max |logit| (max diff {diff})",
                   rc == 0 and diff <= EXACT_TOL * max(1.0, float(np.abs(exact).max())), out)


def losses(metrics):
    return [json.loads(line)["loss"] for line in open(metrics) if '"eval' not in line]


def check_train(work):
    p = os.environ
    plain = os.path.join(work, "q-plain")
    bc.quantize(os.path.join(work, "bf16"), plain, double_quant=False)
    runs = {}
    for label, base in (("bnb-4bit save (fp32 absmax)", plain), ("bf16 weights", os.path.join(work, "bf16")),
                        ("bnb-4bit save (double quantization)", os.path.join(work, "q"))):
        metrics = os.path.join(work, f"m{len(runs)}.jsonl")
        rc, out = run([p["FSDP_RUN"], "--nproc-per-node", "2", "--timeout-s", "100", "--", p["FSDP_TRAIN"],
                       "--init-from", base, *TRAIN, "--metrics", metrics], timeout=180)
        runs[label] = losses(metrics) if rc == 0 else None
        nf4 = "NF4 (bitsandbytes)" in out
        record(f"fsdp-train --init-from {label}, lora.base_dtype=nf4: 3 steps"
               + (", the import reads NF4 (bitsandbytes)" if "save" in label else ""),
               rc == 0 and (nf4 or "save" not in label) and all(np.isfinite(runs[label] or [np.nan])), out)
    a, b = runs["bnb-4bit save (fp32 absmax)"], runs["bf16 weights"]
    record(f"losses from the save without double quantization equal those from its bf16 weights: {a} vs {b}",
           a is not None and a == b)
    check_in_place(work)


def check_in_place(work):
    """The frozen base in the disk tier (Note [A stored form in the disk tier]) with its NF4 codes read
    in place from the save's files (Note [NF4 codes read in place]), on a wider model (hidden 512) so
    that each rank's codes span many pages: the same losses as the base in memory and as the tier
    holding a copy of the codes (lora.base_in_place=false), whose files take the codes' bytes more
    disk; and a save of the base (lora.save_base) from it, read through those files, holds what the
    run in memory saves."""
    p = os.environ
    wide = dict(SMALL, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**wide)).to(torch.bfloat16).save_pretrained(os.path.join(work, "wide-bf16"))
    q = os.path.join(work, "wide-q")
    bc.quantize(os.path.join(work, "wide-bf16"), q)
    tier = ["--set", "fsdp.offload.params=disk", "--set", f"fsdp.offload.dir={os.path.join(work, 'tier')}"]
    saved = {}
    for label, extra in (("memory", []), ("in place", tier), ("copy", tier + ["--set", "lora.base_in_place=false"])):
        metrics, ckpt = os.path.join(work, f"m-{label}.jsonl"), os.path.join(work, f"ckpt-{label}")
        rc, out = run([p["FSDP_RUN"], "--nproc-per-node", "2", "--timeout-s", "100", "--", p["FSDP_TRAIN"],
                       "--init-from", q, *TRAIN, *extra, "--set", "lora.save_base=true", "--save-dir", ckpt,
                       "--metrics", metrics], timeout=180)
        merged = os.path.join(work, f"merged-{label}")
        rc2, _ = run([p["FSDP_CKPT"], "export", "--merged", "--dtype", "float32", os.path.join(ckpt, "step-00000003"),
                      merged], timeout=120) if rc == 0 else (1, "")
        m = re.search(r"disk tier \(rank 0\): ([0-9.]+) MiB on disk", out)
        saved[label] = {"out": out, "losses": losses(metrics) if rc == 0 else None,
                        "tensors": bc.read_dir(merged) if rc2 == 0 else None, "disk": float(m.group(1)) if m else None}
        record(f"fsdp-train --init-from a bnb-4bit save, the base {label}" +
               ("" if label == "memory" else " (fsdp.offload.params=disk)") + f": 3 steps, losses {saved[label]['losses']}",
               rc == 0 and (label == "memory" or saved[label]["disk"] is not None), out)
    a, b, c = (saved[k]["losses"] for k in ("memory", "in place", "copy"))
    record(f"the base's codes read in place: losses bitwise equal to the base in memory and to a copy in the tier: "
           f"{b} vs {a} vs {c}", a is not None and a == b == c)
    # 7 NF4 weights per layer (q, o 512x512; k, v 256x512; gate, up, down 512x1024), 2 layers, half a
    # byte a value, half of them per rank; whole pages of each range only (its edge pages stay).
    codes = 2 * (2 * 512 * 512 + 2 * 256 * 512 + 3 * 512 * 1024) / 2 / 2 / (1 << 20)
    d_in, d_copy = saved["in place"]["disk"], saved["copy"]["disk"]
    record(f"the tier's files take {d_in} MiB of disk on rank 0 with the codes read in place, {d_copy} MiB with a "
           f"copy of them ({codes:.3f} MiB of codes per rank)",
           d_in is not None and d_copy is not None and d_copy - d_in >= 0.8 * codes and d_in < d_copy / 2)
    mem, disk = saved["memory"]["tensors"], saved["in place"]["tensors"]
    same = mem is not None and disk is not None and mem.keys() == disk.keys() and all(
        np.array_equal(mem[k], disk[k]) for k in mem)
    record(f"a save of the base read in place (lora.save_base, fsdp-ckpt export --merged) equals the run in "
           f"memory's, tensor for tensor ({len(mem or {})} tensors)", same, saved["in place"]["out"])


def expect_error(tool, q, what, *needles):
    rc, out, _, _ = bc.run_tool(tool, q, np.arange(4), os.path.join(os.path.dirname(q), "err"))
    record(f"{what}: refused, naming {', '.join(needles)}", rc == 1 and all(n in out for n in needles), out)


def set_config(q, quantization):
    path = os.path.join(q, "config.json")
    cfg = json.load(open(path))
    if quantization is None:
        cfg.pop("quantization_config")
    else:
        cfg["quantization_config"].update(quantization)
    json.dump(cfg, open(path, "w"))


def check_errors(tool, work):
    bf16, name = os.path.join(work, "bf16"), "model.layers.1.mlp.up_proj.weight"
    fp4 = os.path.join(work, "q-fp4")
    bc.quantize(bf16, fp4, quant_type="fp4")
    expect_error(tool, fp4, "an FP4 save", "quantization_config.bnb_4bit_quant_type", '"fp4"')
    set_config(fp4, {"bnb_4bit_quant_type": "nf4"})  # the config disagreeing with its tensors
    expect_error(tool, fp4, "FP4 tensors", "model.layers.0.mlp.down_proj.weight", 'quant_type="fp4"')
    block = os.path.join(work, "q-block")
    shutil.copytree(os.path.join(work, "q"), block)
    bc.edit_quant_state(block, name, blocksize=128)
    expect_error(tool, block, "blocksize 128", name, "blocksize=128")
    bc.edit_quant_state(block, name, blocksize=64, shape="[256, 128]")  # a string where a list belongs
    expect_error(tool, block, "a malformed quant_state", name, "not a bitsandbytes 4-bit state")
    # An 8-bit save as transformers writes it: int8 weights with their row scales, W.SCB.
    int8 = os.path.join(work, "q-int8")
    shutil.copytree(bf16, int8)
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(int8, "model.safetensors"))
    w = tensors[name].float()
    scb = w.abs().amax(1)
    tensors[name] = torch.round(w / scb[:, None] * 127).to(torch.int8)
    tensors[name + ".SCB"] = scb
    save_file(tensors, os.path.join(int8, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(int8, "config.json")))
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    json.dump(cfg, open(os.path.join(int8, "config.json"), "w"))
    expect_error(tool, int8, "an 8-bit save", "quantization_config.load_in_8bit")
    set_config(int8, None)
    expect_error(tool, int8, "8-bit tensors", name + ".SCB", "load_in_8bit")


def main():
    tool = sys.argv[1]
    work = tempfile.mkdtemp(prefix="fsdp-bnb-")
    try:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16).save_pretrained(os.path.join(work, "bf16"))
        bc.quantize(os.path.join(work, "bf16"), os.path.join(work, "q"))
        check_parity(tool, os.path.join(work, "q"), work)
        check_train(work)
        check_errors(tool, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
