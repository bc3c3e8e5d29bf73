"""bench/scale.py --lora nf4: a QLoRA scale run end to end on 2 ranks, at any published shape up to
Llama-3.1-8B (16 GB of bf16 weights).

The model directory is written one safetensors file at a time (bench/write_model.py: no process
holds the whole model), the token file and dd's rates as in scale.py. Then, each in fresh processes
under fsdp-run, OMP_NUM_THREADS=1 per rank, the files evicted from the page cache before each phase:
  baseline       fsdp-train --init-only (the libraries, no model)
  import         --init-from HF --steps 0 (the NF4 base stored as each flat param's tensors are read)
  train          --steps 3 --save-dir CKPT (adapters only: lora.save_base false)
  resume         --resume latest --steps 4 (the base imported again, the adapters loaded, one step)
  export-adapter fsdp-ckpt export CKPT/step-00000004 ADAPTER (a PEFT adapter)
  export-merged  fsdp-ckpt export --merged --dtype bfloat16 CKPT/step-00000004 MERGED (streams the base)
  peft-check     a truncated copy of the config (--check-layers decoder layers, same tensors per
                 layer): 2 steps of the same run, its adapter exported, transformers + peft's
                 PeftModel.from_pretrained on the base in fp32, logits on a fixed prompt against
                 fsdp-ckpt logits of the checkpoint (an unsharded fp32 reference of the whole 8B model
                 does not fit this machine).
LoRA r=16, alpha=32 on q,k,v,o,gate,up,down; the targets' weights in NF4, the rest of the base in the
compute dtype; the compute dtype of --param-dtype (default float32: on a CPU without AVX512-BF16 or
AMX LibTorch's bf16 matmul falls back to a slow path), activation checkpointing on every layer,
AdamW, seq_len and batch per rank as given. The truncated check runs in fp32 either way. fsdp.split_root "auto" (the embedding and the head as units of their own
where the head is untied).
"""
import json
import math
import os
import subprocess
import sys

from scale_common import (MIB, PROMPT_LEN, ROOT, compare_logits, cpu_bf16_text, dd_bandwidth, dir_bytes,
                          parse_ckpt_peak, parse_train_log, run_phase, say, warm, read_libraries_whole)

LORA = ["--set", "lora.r=16", "--set", "lora.alpha=32", "--set", "lora.base_dtype=nf4"]
CHECK_TOL = 1e-3  # fp32 on both sides, the same bf16 base values and adapters: only the order of operations differs


def write_model(hf, model, layers=0, bnb=False, reuse=False):
    """Writes the model (reuse: a --keep folder's finished one is kept, e.g. a 40 GB 70B written once)."""
    done = os.path.join(hf, ".written")
    if not (reuse and os.path.exists(done)):
        write_model_files(hf, model, layers, bnb)
        open(done, "w").close()
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    total = index["metadata"]["total_size"]
    params = total // 2
    if bnb:  # codes (half a byte per value) and their companions: count the values by the model's shapes
        params = json.load(open(os.path.join(hf, "config.json")))
        from write_model import tensor_list
        spec = {k: v for k, v in params.items() if k not in ("quantization_config", "architectures", "transformers_version")}
        params = sum(math.prod(shape) for _, shape in tensor_list(spec)[1])
    return params, len(set(index["weight_map"].values())), dir_bytes(hf)


def write_model_files(hf, model, layers, bnb):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "write_model.py"), "--model", model, hf]
    if layers:
        cmd += ["--layers", str(layers)]
    if bnb:
        cmd += ["--bnb-4bit", "--shard-mb", "2000"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def matmul_rate(spec, seq_len):
    """bench/matmul_rate.py on the step's own product ([seq_len x hidden] by [hidden x intermediate], one
    thread per process, two at once): GFLOP/s per process."""
    import re
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "matmul_rate.py"), "--tokens", str(seq_len),
                          "--hidden", str(spec["hidden_size"]), "--inner", str(spec["intermediate_size"]),
                          "--reps", "20"], capture_output=True, text=True, check=True).stdout
    return [float(x) for x in re.findall(r"([0-9.]+)(?:,| GFLOP/s)", out.split(":")[-1])]


def step_floors(spec, args, rate, phases, dd):
    """A step's two floors: its products at the measured matmul rate (per rank: forward, the layers'
    recomputation and the input gradients through the layers' and the head's weights, plus the
    adapters' own; attention's products at this seq_len are under 1% and left out), and the bytes
    both ranks read from the disk (the tier's measured reads per step) at dd's cold read rate."""
    h, i, L = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"]
    kv = h // spec["num_attention_heads"] * spec["num_key_value_heads"]
    layers = L * (2 * h * h + 2 * kv * h + 3 * h * i)
    head = spec["vocab_size"] * h
    lora = L * 16 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))  # r = 16 on the seven projections
    tokens = args.seq_len * args.batch
    flops = 2 * tokens * (3 * layers + 2 * head + 4 * lora)
    reads = [p["measured_disk_io_mib"][0] for p in phases if p.get("measured_disk_io_mib")]
    out = {"flops_per_rank": flops, "matmul_gflops": rate, "compute_floor_s": flops / (sum(rate) / len(rate) * 1e9)}
    if reads:
        out["disk_bytes_per_step"] = 2 * reads[0] * MIB  # both ranks read their shards
        out["disk_floor_s"] = out["disk_bytes_per_step"] / dd["read_Bps"]
    return out


def trace_breakdown(path):
    """Rank 0's last traced step: its wall time, the compute thread's time in the NF4 decode, waiting
    for disk reads and for all-gathers, and the tier's read thread's busy time (how much of the disk's
    work ran under compute: busy minus the compute thread's wait for it)."""
    from trace_report import load, steps_of
    events = load(path)
    lo, hi = steps_of(events)[-1]
    spent = {}
    for e in events:
        if lo <= e["ts"] < hi:
            spent[e["name"]] = spent.get(e["name"], 0.0) + min(e["dur"], hi - e["ts"]) / 1e6
    out = {"step_s": (hi - lo) / 1e6, "decode_s": spent.get("fsdp::decode", 0.0),
           "disk_wait_s": spent.get("fsdp::disk_read_wait", 0.0),
           "all_gather_wait_s": spent.get("fsdp::all_gather_wait", 0.0),
           "disk_read_busy_s": spent.get("fsdp::disk_read", 0.0),
           "forward_s": spent.get("train::forward", 0.0), "backward_s": spent.get("train::backward", 0.0),
           "optimizer_s": spent.get("train::optimizer", 0.0)}
    out["disk_under_compute_s"] = max(0.0, out["disk_read_busy_s"] - out["disk_wait_s"])
    out["other_compute_s"] = out["step_s"] - out["decode_s"] - out["disk_wait_s"] - out["all_gather_wait_s"]
    return out


def peft_logits(base, adapter, tokens, out):
    """(Run as a child: `scale.py --peft-logits BASE ADAPTER TOKENS OUT`) transformers + peft, fp32."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    model.eval()
    with torch.no_grad():
        np.save(out, model(input_ids=torch.from_numpy(np.load(tokens))).logits.float().numpy())


def run_lora(args, spec, bin_dir, work):
    import numpy as np
    hf, ckpt = os.path.join(work, "hf"), os.path.join(work, "ckpt")
    adapter, merged = os.path.join(work, "adapter"), os.path.join(work, "merged")
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    say(f"{args.model}: writing the model from its published config (" +
        ("a bitsandbytes 4-bit save, random codes" if args.bnb_4bit else "random bf16") +
        f"), one file at a time, in {hf}")
    params, files, weights = write_model(hf, args.model, bnb=args.bnb_4bit, reuse=bool(args.keep))
    vocab = spec["vocab_size"]
    tokens = os.path.join(work, "train.bin")
    np.random.default_rng(0).integers(0, vocab, size=args.tokens, dtype=np.uint32).tofile(tokens)
    prompt = os.path.join(work, "prompt.npy")
    np.save(prompt, np.random.default_rng(1).integers(0, vocab, size=(1, PROMPT_LEN), dtype=np.int64))
    say(f"{params / 1e6:.1f}M parameters, {weights / MIB:,.0f} MiB in {files} files; dd on " +
        ("4 GiB (the disk holds the save once)" if args.bnb_4bit else "as many bytes"))
    dd = dd_bandwidth(work, min(weights, 4 << 30) if args.bnb_4bit else weights)  # 40 GB twice: not on this disk
    if args.libraries in ("read-whole", "fresh-install"):
        read_libraries_whole(bin_dir, work, start_once=args.libraries == "read-whole")
    else:
        warm(bin_dir)
    rate = matmul_rate(spec, args.seq_len) if args.bnb_4bit else None  # the compute floor's rate, on the quiet machine
    data = [hf, ckpt, adapter, merged, tokens]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    floor = args.mem_floor_mib * MIB
    run = [os.path.join(bin_dir, "fsdp-run"), "--nproc-per-node", "2", "--timeout-s", "7200", "--"]

    def train_cmd(hf_dir):
        return [os.path.join(bin_dir, "fsdp-train"), "--init-from", hf_dir, *LORA,
                "--set", "data.source=file", "--set", f"data.path={tokens}", "--set", "data.token_dtype=uint32",
                "--set", f"data.seq_len={args.seq_len}", "--set", f"data.batch_size_per_rank={args.batch}",
                "--set", f"fsdp.param_dtype={args.param_dtype}", "--set", "train.activation_checkpointing=1",
                "--set", "fsdp.timeout_s=900", "--set", "train.eval_every=0", "--set", "train.log_every=1",
                *(["--set", "fsdp.offload.params=disk", "--set", f"fsdp.offload.dir={work}/tier"]
                  if args.bnb_4bit else [])]

    train = train_cmd(hf)
    ckpt_tool = os.path.join(bin_dir, "fsdp-ckpt")
    phases, ok = [], {}

    def phase(name, cmd, metrics=None, trace=None, train_log=False):
        res, out = run_phase(name, cmd, logs, env, floor, data)
        if train_log:
            parse_train_log(out, res, metrics, trace)
        parse_ckpt_peak(out, res)
        phases.append(res)
        ok[name] = res["rc"] == 0
        return res

    base = phase("baseline", run + train + ["--init-only"], train_log=True)
    phase("import", run + train + ["--steps", "0"], train_log=True)
    m_train = os.path.join(work, "train.jsonl")
    n = args.steps
    tr = phase("train", run + train + ["--steps", str(n), "--save-dir", ckpt, "--metrics", m_train], m_train,
               train_log=True)
    m_res = os.path.join(work, "resume.jsonl")
    trace = os.path.join(work, "resume-trace.json")  # the bnb run's step, traced (its overlap of disk and compute)
    if ok["train"]:
        res = phase("resume", run + train + ["--steps", str(n + 1), "--save-dir", ckpt, "--resume", "latest",
                                             "--metrics", m_res] + (["--trace", trace] if args.bnb_4bit else []),
                    m_res, train_log=True)
        if args.bnb_4bit and os.path.exists(trace.replace(".json", ".rank0.json")):
            res["trace_breakdown"] = trace_breakdown(trace.replace(".json", ".rank0.json"))
    final = os.path.join(ckpt, f"step-{n + 1 if ok.get('resume') else n:08d}")
    sizes = {"hf_bytes": dir_bytes(hf)}
    if os.path.isdir(final):
        sizes["checkpoint_step_bytes"] = dir_bytes(final)
        phase("export-adapter", [ckpt_tool, "export", final, adapter])
        if ok["export-adapter"]:
            sizes["adapter_bytes"] = dir_bytes(adapter)
        if not args.bnb_4bit:  # a bnb-4bit base merged is bf16: 141 GB at 70B
            phase("export-merged", [ckpt_tool, "export", "--merged", "--dtype", "bfloat16", final, merged])
            if ok["export-merged"]:
                sizes["merged_bytes"] = dir_bytes(merged)
                subprocess.run(["rm", "-rf", merged], check=False)  # 16 GB at 8B
    # The bnb-4bit import's parity with bitsandbytes is bench/nf4_check.py's and the BnB tests'.
    logits = {} if args.bnb_4bit else peft_check(args, bin_dir, work, env, floor, prompt, tokens, phase)
    floors = step_floors(spec, args, rate, phases, dd) if args.bnb_4bit else None
    return {
        "floors": floors,
        "model": args.model, "lora": "nf4", "published_config": spec, "config_keys_dropped": [], "params": params,
        "files": files, "weights_bytes": weights, "dd": dd, "phases": phases, "fsdp2": None, "sizes": sizes,
        "logits": logits, "baseline_rss": base.get("peak_rss_bytes"),
        "train_steps": (tr.get("steps") or []) + [s for p in phases if p["phase"] == "resume"
                                                  for s in p.get("steps", [])[-1:]],
        "conditions": (f"2 ranks on {os.cpu_count()} cores, OMP_NUM_THREADS=1; fsdp-run, shared-memory transport, "
                       f"FULL_SHARD, QLoRA: r=16, alpha=32 on the seven projections, their weights in NF4, "
                       f"{args.param_dtype} compute ({cpu_bf16_text()}), "
                       f"activation checkpointing on every layer, fsdp.split_root auto, AdamW, adapters-only "
                       f"checkpoints, seq_len {args.seq_len}, batch {args.batch} per rank, random uint32 tokens; "
                       f"before each phase the model, checkpoint, export and token files are evicted from the page "
                       f"cache (posix_fadvise DONTNEED), " + {
                           "read-whole": "each program started once (--help) before the phases, its libraries "
                                         "read whole first from a copy of their own (dd oflag=direct, then a whole "
                                         "read: large folios, as an install leaves them)",
                           "fresh-install": "its libraries read whole from a copy of their own (dd oflag=direct, "
                                            "then a whole read: large folios, as an install leaves them) and no "
                                            "program started before the phases (a fresh install)",
                           "started-once": "each program started once (--help) before the phases, its libraries "
                                           "cached as a process maps them"}[args.libraries]) + (
                           "; the base a bitsandbytes 4-bit NF4 save (bench/write_model.py --bnb-4bit: random "
                           "codes, double-quantized absmax) imported as it is, in the disk tier "
                           "(fsdp.offload.params=disk) with its codes read in place from the save's files; no merged "
                           "export, no peft check" if args.bnb_4bit else ""),
    }


def peft_check(args, bin_dir, work, env, floor, prompt, tokens, phase):
    """The truncated model: fsdp's logits of a LoRA checkpoint against transformers + peft on its export."""
    import numpy as np
    hf = os.path.join(work, "hf-check")
    ckpt, adapter = os.path.join(work, "ckpt-check"), os.path.join(work, "adapter-check")
    write_model(hf, args.model, layers=args.check_layers)
    run = [os.path.join(bin_dir, "fsdp-run"), "--nproc-per-node", "2", "--timeout-s", "3600", "--"]
    train = [os.path.join(bin_dir, "fsdp-train"), "--init-from", hf, *LORA,
             "--set", "data.source=file", "--set", f"data.path={tokens}", "--set", "data.token_dtype=uint32",
             "--set", f"data.seq_len={args.seq_len}", "--set", "data.batch_size_per_rank=1",
             "--set", "fsdp.param_dtype=float32", "--set", "train.eval_every=0", "--set", "optim.warmup_steps=0"]
    ckpt_tool = os.path.join(bin_dir, "fsdp-ckpt")
    phase("check-train", run + train + ["--steps", "2", "--save-dir", ckpt], train_log=True)
    final = os.path.join(ckpt, "step-00000002")
    ours, theirs = os.path.join(work, "logits-fsdp.npy"), os.path.join(work, "logits-peft.npy")
    phase("check-export", [ckpt_tool, "export", final, adapter])
    phase("check-logits-fsdp", [ckpt_tool, "logits", final, prompt, ours])
    me = [sys.executable, os.path.join(ROOT, "bench", "scale.py"), "--peft-logits", hf, adapter]
    phase("check-logits-peft", me + [prompt, theirs])
    name = (f"fsdp-ckpt logits(LoRA checkpoint: its trained adapters on the bf16 base it imports from the run's "
            f"--init-from; the NF4 base is not in this comparison) vs transformers + peft fp32 (the same bf16 base "
            f"+ exported adapter), {args.check_layers} layers")
    if not (os.path.exists(ours) and os.path.exists(theirs)):
        return {name: {"error": "a side did not run", "ok": False}}
    # The checkpoint holds the adapters; fsdp-ckpt logits runs them on the bf16 base it imports (the
    # run's --init-from), as peft does: both sides have the same weights, in fp32.
    scale_ = max(1.0, float(np.abs(np.load(ours)).max()))
    result = compare_logits(ours, theirs, CHECK_TOL * scale_)
    # The adapters moved from their start (lora_B starts at zero): the check compares trained adapters.
    from safetensors.numpy import load_file
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    result["lora_B_abs_max"] = max(float(np.abs(v).max()) for k, v in tensors.items() if "lora_B" in k)
    if result["lora_B_abs_max"] == 0:
        result["ok"] = False
    return {name: result}
