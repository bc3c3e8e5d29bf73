#!/usr/bin/env python3
"""A scale run of a published model shape end to end on 2 ranks: import, train, save, resume,
export, logits against transformers, and PyTorch FSDP2 on the same model and data, with wall time,
peak RSS per rank against fsdp-train's memory plan, and bytes moved against the disk's bandwidth.

transformers builds the model from the published config.json (Qwen/Qwen2.5-0.5B,
meta-llama/Llama-3.2-1B, or `tiny`, a Qwen2 of the same keys at hidden 64 for testing), random init,
bf16, saved over several safetensors files; the model is deleted before anything else runs. A
seeded file of random uint32 token ids is the training data. dd then writes (conv=fdatasync) and
reads (page cache dropped when permitted, else the file's pages evicted) a file as large as the
weights (at least 64 MiB) in the same folder: the disk's sequential bandwidth. The programs and their
libraries are started once (--help, so that the libraries' pages are cached as a process maps them,
not in the large folios a whole-file read leaves); then, each in fresh processes, on 2 ranks (fsdp-run), bf16 compute, AdamW
state in the disk tier (fsdp.offload.optimizer_state=disk), OMP_NUM_THREADS=1, the model, checkpoint,
export and token files evicted from the page cache before each phase (posix_fadvise DONTNEED):
  baseline  fsdp-train --init-only: each rank's RSS with the libraries loaded, no model;
  import    fsdp-train --init-from HF --steps 0;
  train     --init-from HF --steps 3 --save-dir CKPT (the save's own time from --trace's
            train::checkpoint_save span); with the state in the disk tier the save is written
            during step 3's optimizer step (train.save_in_step auto);
  train-plain-save  the same, train.save_in_step=off (its save reads the state back; its step 3
            is what a save written during step 3 is costed against; its checkpoint removed after);
  resume    --init-from HF --save-dir CKPT --resume latest --steps 4 (one more step, saved);
  train-memory  --init-from HF --steps 3 with nothing offloaded (FSDP2's placement), where the plan
            fits this machine (fsdp-train refuses it before allocating otherwise), saved at the end
            (a save from memory; that checkpoint is removed after);
  unsharded-fp32  bench_unsharded: the same model (random weights) and per-rank batch in plain
            LibTorch, one process, fp32 (it has no bf16), where 16 bytes per parameter fit;
  export    fsdp-ckpt export --dtype bfloat16 CKPT/step-00000004 OUT;
  logits    fsdp-ckpt logits (LibTorch, fp32) of the checkpoint and of OUT, and transformers'
            logits of OUT loaded in float32 and in bfloat16, on a fixed 16-token prompt;
  fsdp2     bench/scale_fsdp2.py under torchrun, 3 steps on the same batches (run last, alone,
            under a memory guard: a run that does not fit is reported with the phase it reached).
Per phase: wall time; peak RSS per rank (fsdp-train's "peak RSS per rank" line, which covers the
save; else the command's ru_maxrss, from wait4 in a small process that forks it); the memory
plan's total and measured / plan; bytes read and written as the kernel's block I/O accounting of
the phase's processes (wait4's
ru_inblock / ru_oublock: reads served from the page cache are not counted, writes are counted when
pages are dirtied, including those of files unlinked before writeback); rate = bytes / wall against
dd's (the write: the faster of conv=fdatasync and oflag=direct; a save that reads its state from the
disk tier is also set against dd's copy within the folder, which reads and writes each byte). Results: bench/results/scale-<model>.json and .md.

With --lora nf4 (any model, llama-3.1-8b included) the run is QLoRA's instead: bench/scale_lora.py
says what it runs; results go to bench/results/scale-<model>-qlora.json and .md. With --bnb-4bit too
(llama-3.1-70b runs only so) the model is a bitsandbytes 4-bit save imported as it is, its base in
the disk tier with the codes read in place from the save's files (-qlora-bnb results).

Usage: bench/scale.py [--model qwen2.5-0.5b|llama-3.2-1b|llama-3.1-8b|llama-3.1-70b|tiny] [--lora nf4]
       [--bnb-4bit] [--steps N] [--bin build/bin] [--keep DIR]   (the venv's python; scripts/bench scale runs it)
"""
import argparse
import ctypes
import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_common import (CONFIGS, MIB, PROMPT_LEN, QWEN25_05B, LLAMA32_1B, ROOT, TINY,  # noqa: E402,F401
                          compare_logits, cpu_bf16_text, dd_bandwidth, dir_bytes, drop_caches, evict,
                          mem_available, parse_ckpt_peak, parse_train_log, run_phase, say, warm)

# name: (config, max_shard_size for save_pretrained, config.json keys removed before import unless
# --keep-all-keys). None: fsdp-train reads each of these configs whole (Qwen2.5's use_mrope false too).
MODELS = {
    "qwen2.5-0.5b": (QWEN25_05B, "300MB", []),  # 4 files: the 272 MB embedding, 3 of layers
    "llama-3.2-1b": (LLAMA32_1B, "350MB", []),  # about 9 files: the 525 MB embedding, 2 layers per file
    "tiny": (TINY, "50KB", []),  # 5 files
    "llama-3.1-8b": (None, "250MB", []),  # --lora nf4 only: bench/write_model.py writes it (66 files)
    "llama-3.1-70b": (None, "2000MB", []),  # --lora nf4 --bnb-4bit only: a 40 GB bnb-4bit save
}
FP32_TOL = 1e-3  # same weights, fp32 in both: only the order of operations differs
BF16_REL_TOL = 2**-5  # x max |logit|: bf16 weights (2^-9 relative) or bf16 compute across ~all layers
LOSS_TOL = 1e-2  # nats: fsdp vs FSDP2 step-1 loss, both computing in bf16 from the same weights and batch


def build_model(hf_dir, spec, shard_size, drop, seed):
    """The published config, random init, bf16, several files; returns (params, files, bytes)."""
    import torch
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**spec)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf_dir, max_shard_size=shard_size)
    del model, config
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the freed arenas back before the phases run
    except OSError:
        pass
    path = os.path.join(hf_dir, "config.json")
    saved = json.load(open(path))
    for key in drop:
        saved.pop(key, None)
    json.dump(saved, open(path, "w"), indent=2)
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    return params, len(files), sum(os.path.getsize(f) for f in files)


def optim_defaults(bin_dir):
    """fsdp-train's optimizer defaults and train.seed, from its --help."""
    text = subprocess.run([os.path.join(bin_dir, "fsdp-train"), "--help"], capture_output=True, text=True).stdout
    found = {}
    for key, value in re.findall(r"^\s+(optim\.\w+|train\.seed) = (\S+)", text, re.M):
        found[key.split(".")[1]] = json.loads(value)
    return found


def hf_logits(model_dir, dtype, tokens, out):
    """(Run as a child: `scale.py --hf-logits DIR DTYPE TOKENS OUT`) transformers' logits, as float32."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(np.load(tokens))).logits.float().numpy()
    np.save(out, logits)


def mib(x):
    if x is None:
        return "-"
    return f"{x / MIB:,.0f}" if x >= 100 * MIB else f"{x / MIB:.2g}" if x < MIB else f"{x / MIB:.1f}"


def phase_plan(p, export_plan=None):
    """The plan a phase's whole process is held to: a run with no step (import) its load's, one with
    steps the plan's peak over the load, the steps and a save; the step's alone in older results; an
    export (fsdp-ckpt, one process) the plan's export as the training run printed it: a PEFT
    adapter export (export-adapter) the adapter export's, where the plan printed one."""
    if p.get("phase") == "import" and p.get("plan_load_bytes"):
        return p["plan_load_bytes"]
    if p.get("phase", "").startswith("export"):
        plans = export_plan or {}
        if p["phase"] == "export-adapter" and plans.get("adapter"):
            return plans["adapter"]
        return plans.get("converting")
    return p.get("plan_peak_bytes") or p.get("plan_bytes")


def disk_line(dd):
    if "write_direct_Bps" not in dd:  # a results file from before the O_DIRECT figure
        return (f"write {dd['write_Bps'] / 1e6:,.0f} MB/s (conv=fdatasync), read {dd['read_Bps'] / 1e6:,.0f} MB/s "
                f"({dd['read_cache']})")
    return (f"write {dd['write_Bps'] / 1e6:,.0f} MB/s, the faster of conv=fdatasync "
            f"({dd['write_fdatasync_Bps'] / 1e6:,.0f}) and oflag=direct ({dd['write_direct_Bps'] / 1e6:,.0f}); read "
            f"{dd['read_Bps'] / 1e6:,.0f} MB/s ({dd['read_cache']}); a copy within the folder (iflag=direct "
            f"oflag=direct: each byte read and written) {dd['copy_Bps'] / 1e6:,.0f} MB/s. The save's fraction is of "
            f"the write figure; a save that reads its state from the disk tier also gets its fraction of the copy")


def save_rates(dd, rate, reads_tier):
    out = f"{rate / dd['write_Bps']:.2f} of dd's write"
    if reads_tier and dd.get("copy_Bps"):
        out += f", {rate / dd['copy_Bps']:.2f} of dd's copy: its state is read from the disk tier"
    return out


def optimizer_s(phase, step):
    """The optimizer phase's seconds of `step` in a phase's metrics, or None."""
    for st in phase.get("steps", []):
        if st["step"] == step and st.get("phase_s"):
            return st["phase_s"].get("optimizer")
    return None


def in_step_save_line(r, p, sv, dd):
    """A save written during its step costs the time after it plus what it added to the step's
    optimizer phase against the same step of train-plain-save."""
    plain = next((q for q in r["phases"] if q["phase"] == "train-plain-save"), None)
    ref_step = sv["step"]
    if plain and optimizer_s(plain, ref_step) is None:  # a resumed step past the plain run's last: its last
        ref_step = max((st["step"] for st in plain.get("steps", [])), default=0)
    ref = optimizer_s(plain, ref_step) if plain else None
    head = (f"- {p['phase']}: save of step {sv['step']}, written during its optimizer step: "
            f"{sv['in_step_bytes'] / MIB:,.0f} of {sv['bytes'] / MIB:,.0f} MiB written during the step, whose "
            f"optimizer phase took {sv['optimizer_s']:.2f} s; {sv['seconds']:.2f} s after the step")
    if ref is None:
        return head + " (no plain-save run to set it against)."
    cost = sv["seconds"] + sv["optimizer_s"] - ref
    rate = sv["bytes"] / max(cost, 0.05)
    return (head + f". The plain-save run's optimizer phase of step {ref_step}: {ref:.2f} s; the save's cost "
            f"{sv['seconds']:.2f} + {sv['optimizer_s']:.2f} - {ref:.2f} = {cost:.2f} s: {rate / 1e6:,.0f} MB/s "
            f"({rate / dd['write_Bps']:.2f} of dd's write); peak RSS per rank during the save "
            f"{' / '.join(mib(x) for x in sv['peak_rss_bytes'])} MiB.")


def report(r):
    dd = r["dd"]
    rows = []
    export_plan = {k: next((p[key] for p in r["phases"] if p.get(key)), None)
                   for k, key in (("converting", "plan_export_bytes"), ("adapter", "plan_export_adapter_bytes"))}
    for p in r["phases"]:
        rss = p.get("peak_rss_bytes") or [p.get("maxrss_bytes")]
        plan = phase_plan(p, export_plan)
        ratio = " / ".join(f"{x / plan:.2f}" for x in rss) if plan else "-"
        above = (" / ".join(f"{(x - b) / plan:.2f}" for x, b in zip(rss, r["baseline_rss"]))
                 if plan and r.get("baseline_rss") else "-")
        rd, wr, wall = p["read_bytes"], p["write_bytes"], p["wall_s"]
        rates = (f"{rd / wall / 1e6:,.0f} ({rd / wall / dd['read_Bps']:.2f}) / "
                 f"{wr / wall / 1e6:,.0f} ({wr / wall / dd['write_Bps']:.2f})")
        status = "ok" if p["rc"] == 0 else "not run" if p.get("not_run") else f"FAILED ({p['rc']})"
        rows.append(f"| {p['phase']} | {status} | {wall:.1f} | {' / '.join(mib(x) for x in rss)} | {mib(plan)} | "
                    f"{ratio} | {above} | {mib(rd)} / {mib(wr)} | {rates} |")
        # Each save's own peak (fsdp-train measures it apart) against the plan's save phase.
        for sv in p.get("save_metrics", []) if p.get("plan_save_bytes") else []:
            save_plan = p["plan_save_bytes"]
            rows.append(f"| {p['phase']}: save of step {sv['step']} | ok | {sv['seconds']:.1f} | "
                        f"{' / '.join(mib(x) for x in sv['peak_rss_bytes'])} | {mib(save_plan)} | "
                        f"{' / '.join(f'{x / save_plan:.2f}' for x in sv['peak_rss_bytes'])} | - | - | - |")
    md = [f"# Scale run: {r['model']}{' QLoRA (NF4 base)' if r.get('lora') else ''} ({r['params'] / 1e6:.1f}M parameters, {r['weights_bytes'] / MIB:,.0f} MiB "
          f"of bf16 weights in {r['files']} files)", "",
          f"Commit: {r.get('commit', 'not recorded')}. Conditions: {r['conditions']}.", "",
          f"Disk (dd, {dd['bytes'] / MIB:,.0f} MiB, same folder): {disk_line(dd)}.", "",
          "| phase | status | wall s | peak RSS per rank MiB | plan MiB | RSS / plan | (RSS - baseline) / plan | "
          "read / written MiB | read / write MB/s (fraction of dd) |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
          "The plan column: for import (no step) the plan's load phase; for a run with steps the plan's peak "
          "over its load, its steps and a save (`peak per rank` in fsdp-train's plan), where fsdp-train printed "
          "one; before the plan had phases, the step's total; a save's row, its own peak (fsdp-train's "
          "`peak RSS per rank during the save`) against the plan's save phase (`a save per rank`).", ""]
    s = r.get("sizes", {})
    for p in r["phases"]:
        # A save written during its step: its span holds only what follows the step (costed below).
        if "save_s" in p and not any("in_step_bytes" in sv for sv in p.get("save_metrics", [])):
            size = s.get("checkpoint_step_bytes", 0)
            md.append(f"- {p['phase']}: the save took {p['save_s']:.2f} s (train::checkpoint_save in --trace) for "
                      f"{size / MIB:,.0f} MiB: {size / p['save_s'] / 1e6:,.0f} MB/s "
                      f"({save_rates(dd, size / p['save_s'], p.get('state_on_disk'))}).")
        for sv in p.get("save_metrics", []):
            if "in_step_bytes" in sv:
                md.append(in_step_save_line(r, p, sv, dd))
                continue
            rate = sv["bytes"] / max(sv["seconds"], 0.05)  # printed to 0.1 s
            md.append(f"- {p['phase']}: save of step {sv['step']} (fsdp-train's stdout): {sv['seconds']:.1f} s for "
                      f"{sv['bytes'] / MIB:,.0f} MiB, {rate / 1e6:,.0f} MB/s "
                      f"({save_rates(dd, rate, p.get('state_on_disk'))}); peak RSS per rank during the save {' / '.join(mib(x) for x in sv['peak_rss_bytes'])} MiB.")
        for st in p.get("steps", []):
            peaks = st.get("phase_peak_rss_bytes") or {}
            md.append(f"- {p['phase']} step {st['step']}: {st['step_time_s']:.2f} s" +
                      ("; peak RSS per rank by phase, MiB: " +
                       "; ".join(f"{k} {' / '.join(mib(x) for x in v)}" for k, v in peaks.items()) if peaks else ""))
        if p.get("plan_disk_io_mib") and p.get("measured_disk_io_mib"):
            (pr, pw), (mr, mw) = p["plan_disk_io_mib"], p["measured_disk_io_mib"]
            md.append(f"- {p['phase']}: disk tier per step after the first, rank 0: read {mr:,.0f} MiB, written "
                      f"{mw:,.0f} MiB; the plan: {pr:,.0f} / {pw:,.0f} MiB.")
        if p.get("plan_settings"):
            md.append(f"- {p['phase']}: the plan's settings: `{p['plan_settings']}`")
        if p.get("not_run"):
            md.append(f"- {p['phase']}: not run: {p['not_run']}.")
        elif "error" in p:
            md.append(f"- {p['phase']} failed: `{p['error'][-400:]}`")
    for p in r["phases"]:
        tb = p.get("trace_breakdown")
        if tb:
            md.append(f"- {p['phase']}: the traced step (rank 0, `--trace`): {tb['step_s']:.1f} s; the compute thread "
                      f"decoding NF4 {tb['decode_s']:.1f} s, waiting for disk reads {tb['disk_wait_s']:.1f} s, for "
                      f"all-gathers {tb['all_gather_wait_s']:.1f} s, the rest (products, norms, the loss, copies) "
                      f"{tb['other_compute_s']:.1f} s; the tier's read thread busy {tb['disk_read_busy_s']:.1f} s, "
                      f"{tb['disk_under_compute_s']:.1f} s of it under compute.")
    fl = r.get("floors")
    if fl:
        rates = ", ".join(f"{x:.0f}" for x in fl["matmul_gflops"])
        md.append(f"- Step floors: the products, {fl['flops_per_rank'] / 1e12:.1f} TFLOP per rank, at the matmul rate "
                  f"measured before the phases (bench/matmul_rate.py on the step's [seq_len x hidden] by [hidden x "
                  f"intermediate], 2 processes of 1 thread: {rates} GFLOP/s): {fl['compute_floor_s']:.0f} s" +
                  (f"; the disk, {fl['disk_bytes_per_step'] / 1e9:.1f} GB read a step by both ranks at dd's cold "
                   f"read rate: {fl['disk_floor_s']:.0f} s" if "disk_floor_s" in fl else "") + ".")
    md.append(f"- Sizes: HF dir {mib(s.get('hf_bytes'))} MiB, one checkpoint {mib(s.get('checkpoint_step_bytes'))} "
              f"MiB, checkpoint dir {mib(s.get('checkpoint_dir_bytes'))} MiB, export {mib(s.get('export_bytes'))} MiB"
              + (f", PEFT adapter {mib(s.get('adapter_bytes'))} MiB, merged bf16 export {mib(s.get('merged_bytes'))} MiB"
                 if r.get("lora") else "") + ".")
    if r.get("logits"):
        md += ["", "Logits on a fixed prompt of 16 tokens (fsdp-ckpt logits runs LibTorch in fp32):", "",
               "| compared | max abs diff | max abs logit | tolerance | argmax agrees | ok |",
               "| --- | --- | --- | --- | --- | --- |"]
        for name, c in r["logits"].items():
            if "max_abs_diff" not in c:
                md.append(f"| {name} | {c.get('error', c.get('shapes'))} | | | | no |")
                continue
            md.append(f"| {name} | {c['max_abs_diff']:.3g} | {c['max_abs_logit']:.3g} | {c['tolerance']:.3g} | "
                      f"{c['argmax_agree']:.0%} ({c['clear_positions']}/{c['positions']} clear: "
                      f"{'all agree' if c['argmax_agree_where_clear'] else 'DIFFER'}) | {'yes' if c['ok'] else 'NO'} |")
        if r.get("lora"):
            b = max((c.get("lora_B_abs_max", 0) for c in r["logits"].values()), default=0)
            md.append("Both sides run the same bf16 base values and the trained adapters (largest |lora_B| "
                      f"{b:.3g}; it starts at zero) in fp32; tolerance 1e-3 x max |logit|.")
        md.append(f"Tolerances: {FP32_TOL} where both sides run the same bf16-stored weights in fp32 (only the order "
                  f"of operations differs); {BF16_REL_TOL} x max |logit| where one side has the fp32 master weights "
                  "and the other their bf16 export, or computes in bf16 (2^-9 relative rounding per weight or "
                  "operation, summed over the layers). Argmax is required to agree only where the top two logits "
                  "are further apart than twice the tolerance.")
    f2 = r.get("fsdp2")
    if f2:
        md += ["", "PyTorch FSDP2 (bench/scale_fsdp2.py: fully_shard per decoder layer and the root, "
               "MixedPrecisionPolicy(bf16, fp32), fp32 weights loaded by every rank, AdamW fused, same batches):", ""]
        if f2.get("fit"):
            fsdp = {s["step"]: s for s in r.get("train_steps", [])}
            in_mem = {s["step"]: s for p in r["phases"] if p["phase"] == "train-memory" for s in p.get("steps", [])}
            md += ["| step | fsdp loss | FSDP2 loss | difference | fsdp step s (state on disk) | "
                   "fsdp step s (in memory) | FSDP2 step s | FSDP2 peak RSS MiB |",
                   "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for s in f2["steps"]:
                ours = fsdp.get(s["step"], {})
                mem_s = in_mem.get(s["step"], {}).get("step_time_s")
                diff = f"{s['loss'] - ours['loss']:+.2e}" if ours else "-"
                md.append(f"| {s['step']} | {ours.get('loss', float('nan')):.5f} | {s['loss']:.5f} | {diff} | "
                          f"{ours.get('step_time_s', float('nan')):.2f} | "
                          f"{'-' if mem_s is None else f'{mem_s:.2f}'} | {s['wall_s']:.2f} | "
                          f"{' / '.join(mib(x) for x in s['peak_rss_bytes'])} |")
            md.append(f"Step-1 loss difference {f2.get('step1_loss_diff', float('nan')):.2e} against a tolerance of "
                      f"{LOSS_TOL} nats (both bf16): {'agrees' if f2.get('step1_agrees') else 'DISAGREES'}. "
                      f"FSDP2 load {f2['load_s']:.1f} s, wall {f2['wall_s']:.1f} s, "
                      f"peak RSS per rank {' / '.join(mib(x) for x in f2['peak_rss_bytes'])} MiB.")
        else:
            what = "did not fit: it ran out" if f2.get("out_of_memory") else "failed"
            md.append(f"FSDP2 {what} in phase `{f2.get('last_phase')}` "
                      f"({f2.get('error', '')[-300:]}); MemAvailable before {mib(f2.get('mem_available_before'))} MiB.")
    md += ["", "Measured by `bench/scale.py` (`scripts/bench scale`)."]
    return "\n".join(md) + "\n"


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "--hf-logits":
        return hf_logits(*sys.argv[2:])
    if len(sys.argv) == 6 and sys.argv[1] == "--peft-logits":
        from scale_lora import peft_logits
        return peft_logits(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--bin", default="build/bin", help="directory of fsdp-run, fsdp-train, fsdp-ckpt")
    ap.add_argument("--batch", type=int, default=1, help="data.batch_size_per_rank")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens in the training file")
    ap.add_argument("--keep-all-keys", action="store_true",
                    help="keep every config.json key (by default the keys MODELS lists are removed; none now)")
    ap.add_argument("--no-fsdp2", action="store_true")
    ap.add_argument("--lora", choices=["nf4"], help="QLoRA's run instead (bench/scale_lora.py)")
    ap.add_argument("--bnb-4bit", action="store_true",
                    help="with --lora: the model written as a bitsandbytes 4-bit save (random codes), imported as it "
                         "is, the base in the disk tier (fsdp.offload.params=disk) with its codes read in place")
    ap.add_argument("--steps", type=int, default=3, help="with --lora: the train phase's steps")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="--lora nf4: fsdp.param_dtype of the training phases (default float32)")
    ap.add_argument("--check-layers", type=int, default=2,
                    help="--lora: decoder layers of the truncated model whose logits are checked against peft")
    ap.add_argument("--libraries", choices=["started-once", "read-whole", "fresh-install"], default="started-once",
                    help="the libraries' page cache: faulted in by starting each program once, or read whole "
                         "first from a copy of their own (as an install leaves them), then started once "
                         "(read-whole) or not (fresh-install: the phases are the first programs run)")
    ap.add_argument("--mem-floor-mib", type=int, default=1024, help="kill a phase below this MemAvailable")
    ap.add_argument("--tmp-dir", default=os.environ.get("FSDP_BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temp folder, removed)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    spec, shard_size, refused = MODELS[args.model]
    if args.bnb_4bit and not args.lora:
        ap.error("--bnb-4bit goes with --lora nf4")
    if args.model == "llama-3.1-70b" and not args.bnb_4bit:
        ap.error("--model llama-3.1-70b runs with --lora nf4 --bnb-4bit only (141 GB of bf16 do not fit this disk)")
    if args.lora:
        spec = CONFIGS[args.model]
    elif spec is None:
        ap.error(f"--model {args.model} runs with --lora nf4 only (its full fine-tune does not fit this machine)")
    drop = [] if args.keep_all_keys else refused
    bin_dir = os.path.abspath(args.bin)
    if args.keep:
        work = os.path.abspath(args.keep)
        os.makedirs(work, exist_ok=True)
    else:
        work = tempfile.mkdtemp(prefix="fsdp-scale-", dir=args.tmp_dir)
    try:
        if args.lora:
            from scale_lora import run_lora
            result = run_lora(args, spec, bin_dir, work)
        else:
            result = run_all(args, spec, shard_size, drop, bin_dir, work)
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", work], check=False)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    result["commit"] = commit.strip() + (" (with uncommitted changes)" if dirty else "")
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"scale-{args.model}" + ("-qlora" if args.lora else "") +
                        ("-bnb" if args.bnb_4bit else ""))
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = report(result)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(md)
    failed = [p["phase"] for p in result["phases"] if p["rc"] != 0 and not p.get("not_run")]
    bad_logits = [k for k, c in result.get("logits", {}).items() if not c.get("ok")]
    f2 = result.get("fsdp2") or {}
    loss_bad = f2.get("step1_agrees") is False
    if failed or bad_logits or loss_bad:
        say(f"failed phases: {failed}; logits outside tolerance: {bad_logits}; "
            f"step-1 loss vs FSDP2: {'disagrees' if loss_bad else 'ok or not compared'}")
        return 1
    return 0


def run_all(args, spec, shard_size, drop, bin_dir, work):
    import numpy as np
    hf, ckpt, export = (os.path.join(work, d) for d in ("hf", "ckpt", "export"))
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    say(f"{args.model}: building the model from its published config (random init, bf16) in {hf}")
    params, files, weights = build_model(hf, spec, shard_size, drop, seed=0)
    vocab = spec["vocab_size"]
    tokens = os.path.join(work, "train.bin")
    np.random.default_rng(0).integers(0, vocab, size=args.tokens, dtype=np.uint32).tofile(tokens)
    prompt = os.path.join(work, "prompt.npy")
    np.save(prompt, np.random.default_rng(1).integers(0, vocab, size=(1, PROMPT_LEN), dtype=np.int64))
    say(f"{params / 1e6:.1f}M parameters, {weights / MIB:,.0f} MiB in {files} files; dd on as many bytes")
    dd = dd_bandwidth(work, weights)
    warm(bin_dir)
    data = [hf, ckpt, export, tokens]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    floor = args.mem_floor_mib * MIB
    run = [os.path.join(bin_dir, "fsdp-run"), "--nproc-per-node", "2", "--timeout-s", "7200", "--"]
    train = [os.path.join(bin_dir, "fsdp-train"), "--init-from", hf,
             "--set", "data.source=file", "--set", f"data.path={tokens}", "--set", "data.token_dtype=uint32",
             "--set", f"data.seq_len={args.seq_len}", "--set", f"data.batch_size_per_rank={args.batch}",
             "--set", "fsdp.param_dtype=bfloat16", "--set", "fsdp.offload.optimizer_state=disk",
             "--set", f"fsdp.offload.dir={os.path.join(work, 'offload')}", "--set", "fsdp.timeout_s=600",
             "--set", "train.eval_every=0", "--set", "train.log_every=1"]
    ckpt_tool = os.path.join(bin_dir, "fsdp-ckpt")
    phases, result = [], {}
    ok = {}

    def phase(name, cmd, metrics=None, trace=None):
        res, out = run_phase(name, cmd, logs, env, floor, data)
        res["state_on_disk"] = (any(c.endswith("fsdp-train") for c in cmd)
                                and "fsdp.offload.optimizer_state=none" not in cmd)
        if "fsdp-train" in " ".join(cmd) or "bench_unsharded" in cmd[0]:
            parse_train_log(out, res, metrics, trace and trace.replace(".json", ".rank0.json"))
        parse_ckpt_peak(out, res)
        phases.append(res)
        ok[name] = res["rc"] == 0
        return res

    base = phase("baseline", run + train + ["--init-only"])
    phase("import", run + train + ["--steps", "0"])
    m_train, t_train = os.path.join(work, "train.jsonl"), os.path.join(work, "train-trace.json")
    tr = phase("train", run + train + ["--steps", "3", "--save-dir", ckpt, "--metrics", m_train, "--trace", t_train],
               m_train, t_train)
    step3 = os.path.join(ckpt, "step-00000003")
    sizes = {"hf_bytes": dir_bytes(hf)}
    if os.path.isdir(step3):
        sizes["checkpoint_step_bytes"] = dir_bytes(step3)
    if ok["train"] and tr.get("state_on_disk"):
        # The same run saving after the step: its step 3 costs the save written during step 3.
        m_plain, ck_plain = os.path.join(work, "train-plain-save.jsonl"), os.path.join(work, "ckpt-plain")
        phase("train-plain-save", run + train + ["--steps", "3", "--save-dir", ck_plain, "--metrics", m_plain,
                                                 "--set", "train.save_in_step=off"], m_plain)
        shutil.rmtree(ck_plain, ignore_errors=True)
    m_res, t_res = os.path.join(work, "resume.jsonl"), os.path.join(work, "resume-trace.json")
    if ok["train"]:
        phase("resume", run + train + ["--steps", "4", "--save-dir", ckpt, "--resume", "latest", "--metrics", m_res,
                                       "--trace", t_res], m_res, t_res)
    # The same steps with everything in memory, where the plan says it fits: the work FSDP2 does.
    m_mem = os.path.join(work, "memory.jsonl")
    # It saves too (and the checkpoint goes): a save from memory, to set beside the one from the disk tier.
    ck_mem = os.path.join(work, "ckpt-memory")
    mem = phase("train-memory", run + train + ["--steps", "3", "--save-dir", ck_mem, "--metrics", m_mem,
                                               "--set", "fsdp.offload.optimizer_state=none"], m_mem)
    shutil.rmtree(ck_mem, ignore_errors=True)
    if mem["rc"] == 2 and "does not fit" in mem.get("error", ""):
        mem["not_run"] = "fsdp-train refused it before allocating: the plan does not fit this machine's memory"
        ok["train-memory"] = True
    # The hardware's figure for a step: plain LibTorch, one process, unsharded, the same per-rank
    # batch (bench_unsharded: fp32 only), where its 16 bytes per parameter fit.
    unsharded = os.path.join(bin_dir, "bench_unsharded")
    if os.path.exists(unsharded) and params * 16 + (4 << 30) < mem_available():
        m_uns = os.path.join(work, "unsharded.jsonl")
        phase("unsharded-fp32", [unsharded] + train[1:] + ["--steps", "3", "--metrics", m_uns], m_uns)
    final = os.path.join(ckpt, "step-00000004") if ok.get("resume") else step3
    logits = {}
    if os.path.isdir(final):
        sizes["checkpoint_dir_bytes"] = dir_bytes(ckpt)
        phase("export", [ckpt_tool, "export", "--dtype", "bfloat16", final, export])
        if ok["export"]:
            sizes["export_bytes"] = dir_bytes(export)
        lg = {k: os.path.join(work, f"logits-{k}.npy") for k in ("ckpt", "export", "hf32", "hf16")}
        phase("logits", [ckpt_tool, "logits", final, prompt, lg["ckpt"]])
        if ok["export"]:
            phase("logits-export", [ckpt_tool, "logits", export, prompt, lg["export"]])
            me = [sys.executable, os.path.abspath(__file__), "--hf-logits", export]
            phase("hf-logits-fp32", me + ["float32", prompt, lg["hf32"]])
            phase("hf-logits-bf16", me + ["bfloat16", prompt, lg["hf16"]])
            pairs = {"fsdp-ckpt logits(export) vs transformers fp32(export)": ("export", "hf32", None),
                     "fsdp-ckpt logits(checkpoint, fp32 master) vs transformers fp32(bf16 export)":
                         ("ckpt", "hf32", BF16_REL_TOL),
                     "fsdp-ckpt logits(checkpoint) vs transformers bf16(export)": ("ckpt", "hf16", BF16_REL_TOL)}
            for name, (a, b, rel) in pairs.items():
                if os.path.exists(lg[a]) and os.path.exists(lg[b]):
                    scale = max(1.0, float(np.abs(np.load(lg[a])).max()))
                    logits[name] = compare_logits(lg[a], lg[b], rel * scale if rel else FP32_TOL)
                else:
                    logits[name] = {"error": "a side did not run", "ok": False}
    result["sizes"] = sizes
    result["logits"] = logits

    fsdp2 = None
    if not args.no_fsdp2:
        optim = optim_defaults(bin_dir)
        seed = optim.pop("seed", 0)
        out = os.path.join(work, "fsdp2.jsonl")
        # fsdp-train's own batches for each rank and step (bench_unsharded builds no model for this).
        batches = os.path.join(work, "batches.bin")
        subprocess.run([unsharded] + train[1:] + ["--steps", "3", "--dump-data", batches, "--world", "2"],
                       check=True, stdout=subprocess.DEVNULL)
        before = mem_available()
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
               os.path.join(ROOT, "bench", "scale_fsdp2.py"), "--hf", hf, "--data", batches,
               "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", "3",
               "--optim", json.dumps(optim), "--out", out]
        res, log = run_phase("fsdp2", cmd, logs, env, floor, data)
        lines = [json.loads(x) for x in open(out)] if os.path.exists(out) else []
        marks = re.findall(r"scale_fsdp2: phase (.+)", log)
        fsdp2 = {"fit": res["rc"] == 0, "rc": res["rc"], "wall_s": res["wall_s"], "mem_available_before": before,
                 "mem_available_low": res["mem_available_low_bytes"], "last_phase": marks[-1] if marks else "start",
                 "optim": optim, "seed": seed, "read_bytes": res["read_bytes"], "write_bytes": res["write_bytes"]}
        if res["rc"] != 0:
            fsdp2["error"] = res.get("error", "")
            fsdp2["out_of_memory"] = ("memory guard" in fsdp2["error"] or res["rc"] in (-9, 137)
                                      or "SIGKILL" in log or "MemoryError" in log)
        steps = [x for x in lines if x["phase"].startswith("step ")]
        for s in steps:
            s["step"] = int(s["phase"].split()[1])
        fsdp2["steps"] = steps
        load = [x for x in lines if x["phase"] == "load"]
        fsdp2["load_s"] = load[0]["wall_s"] if load else None
        fsdp2["peak_rss_bytes"] = lines[-1]["peak_rss_bytes"] if lines else None
        ours = tr.get("steps") or []
        if steps and ours:
            fsdp2["step1_loss_diff"] = steps[0]["loss"] - ours[0]["loss"]
            fsdp2["step1_agrees"] = abs(fsdp2["step1_loss_diff"]) <= LOSS_TOL
        if not fsdp2["fit"]:
            say(f"fsdp2 {'did not fit' if fsdp2['out_of_memory'] else 'failed'} in phase {fsdp2['last_phase']}")

    result.update({
        "model": args.model, "published_config": spec, "config_keys_dropped": drop, "params": params,
        "files": files, "weights_bytes": weights, "dd": dd, "phases": phases, "fsdp2": fsdp2,
        "train_steps": (tr.get("steps") or []) + [s for p in phases if p["phase"] == "resume"
                                                  for s in p.get("steps", [])[-1:]],
        "baseline_rss": base.get("peak_rss_bytes"),
        "conditions": (f"2 ranks on {os.cpu_count()} cores, OMP_NUM_THREADS=1; fsdp: fsdp-run, shared-memory "
                       f"transport, FULL_SHARD, bf16 compute (fsdp.param_dtype), fp32 reduce, AdamW state in the "
                       f"disk tier, seq_len {args.seq_len}, batch {args.batch} per rank, train.eval_every 0; "
                       f"FSDP2: torchrun, Gloo; before each phase the model, checkpoint, export and token files are "
                       "evicted from the page cache (posix_fadvise DONTNEED), each program started once (--help) "
                       "before the phases, its libraries cached as a process maps them"
                       + (f"; config.json keys removed before import: {', '.join(drop)}"
                          if drop else "")),
    })
    return result


if __name__ == "__main__":
    sys.exit(main())
