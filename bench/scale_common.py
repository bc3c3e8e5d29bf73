"""What bench/scale.py, bench/scale_lora.py and bench/write_model.py share: the published model
configs, the phase runner (fresh processes, peak RSS, block I/O, a memory floor), fsdp-train's log
parsed, dd's rates, and the logits comparison. Imported by each of them; imports none of them."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B config.json (revision 060db6499f32faf8b98477b0a26969ef7d8b9987)
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA32_1B = {  # meta-llama/Llama-3.2-1B config.json (revision 4e20de362430cd3b72f300e6b0f18e50e7166e08)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
TINY = dict(QWEN25_05B, hidden_size=64, intermediate_size=176, num_hidden_layers=2, max_window_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, bos_token_id=999, eos_token_id=999)
LLAMA31_8B = {  # meta-llama/Llama-3.1-8B config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
# meta-llama/Llama-3.1-70B config.json: the 8B's but for its sizes.
LLAMA31_70B = dict(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                   num_hidden_layers=80)
CONFIGS = {"llama-3.1-70b": LLAMA31_70B, "llama-3.1-8b": LLAMA31_8B, "llama-3.2-1b": LLAMA32_1B, "qwen2.5-0.5b": QWEN25_05B, "tiny": TINY}
PROMPT_LEN = 16


def say(msg):
    print(f"scale: {msg}", flush=True)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def drop_caches():
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(paths):
    """Drops these files' pages from the page cache (written back first), so the next phase reads them."""
    os.sync()
    for top in paths:
        walk = [(top, [], [""])] if os.path.isfile(top) else os.walk(top)
        for d, _, fs in walk:
            for f in fs:
                try:
                    fd = os.open(os.path.join(d, f), os.O_RDONLY)
                except OSError:
                    continue
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def warm(bin_dir):
    """Starts each program once (--help), so its libraries are cached as a process maps them: a whole
    read leaves them in large folios, ~160 MiB more per process (docs/NOTES.md, "The process's own
    RSS depends on the page cache"), not how the plan's process item was measured."""
    for prog in sorted(glob.glob(os.path.join(bin_dir, "fsdp-*"))):
        subprocess.run([prog, "--help"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_libraries_whole(bin_dir, work, start_once=True):
    """The libraries fsdp-train maps (all but the system's: LibTorch's, CUDA's), copied into WORK/lib
    past the page cache (dd oflag=direct) and read whole (cat), as an install or a copy leaves them:
    the page cache holds them in large folios, whatever other processes map of the originals. The
    programs load them from there (LD_LIBRARY_PATH, returned). Then each program is started once,
    unless `start_once` is false (a fresh install: the first program a user runs is the phase's)."""
    libdir = os.path.join(work, "lib")
    os.makedirs(libdir, exist_ok=True)
    ldd = subprocess.run(["ldd", os.path.join(bin_dir, "fsdp-train")], capture_output=True, text=True).stdout
    libs = [m.group(1) for m in re.finditer(r"=> (/\S+)", ldd) if not re.match(r"/(usr/)?lib(64)?/", m.group(1))]
    for lib in libs:
        subprocess.run(["dd", f"if={lib}", f"of={os.path.join(libdir, os.path.basename(lib))}", "bs=8M",
                        "oflag=direct", "status=none"], check=True)
    for lib in sorted(os.listdir(libdir)):
        with open(os.path.join(libdir, lib), "rb") as f:
            while f.read(1 << 24):
                pass
    os.environ["LD_LIBRARY_PATH"] = libdir + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
    if start_once:
        warm(bin_dir)
    return libdir


def mem_available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def dd_bandwidth(work, nbytes):
    """dd on nbytes in `work`, bytes/s each: the write with conv=fdatasync and with oflag=direct (the
    best of the two is the write figure), the cold read, and a copy of the file within the folder
    (iflag=direct oflag=direct: the disk reads and writes the same bytes, as a save of a state in the
    disk tier does), with the read's cache state."""
    path, copy = os.path.join(work, "dd.bin"), os.path.join(work, "dd-copy.bin")
    count = max(-(-nbytes // MIB), 64)

    def rate(stderr):
        m = re.search(r"^(\d+) bytes .* copied, ([0-9.]+) s", stderr, re.M)
        return int(m.group(1)) / float(m.group(2))

    def dd(*a):
        return rate(subprocess.run(["dd", *a], capture_output=True, text=True, check=True).stderr)

    subprocess.run(["sync"], check=False)
    w_sync = dd("if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync")
    os.remove(path)
    w_direct = dd("if=/dev/zero", f"of={path}", "bs=16M", f"count={-(-count // 16)}", "oflag=direct")
    cold = drop_caches()
    if not cold:
        evict([path])
    read = dd(f"if={path}", "of=/dev/null", "bs=1M")
    copied = dd(f"if={path}", f"of={copy}", "bs=16M", "iflag=direct", "oflag=direct")
    os.remove(path)
    os.remove(copy)
    return {"bytes": count * MIB, "write_Bps": max(w_sync, w_direct), "write_fdatasync_Bps": w_sync,
            "write_direct_Bps": w_direct, "read_Bps": read, "copy_Bps": copied,
            "read_cache": "cold: drop_caches" if cold else "cold: posix_fadvise DONTNEED (drop_caches not permitted)"}


class MemoryGuard(threading.Thread):
    """Kills the process group `pgid` when MemAvailable falls below `floor` bytes."""

    def __init__(self, pgid, floor):
        super().__init__(daemon=True)
        self.pgid, self.floor, self.fired, self.low = pgid, floor, False, mem_available()
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.2):
            avail = mem_available()
            self.low = min(self.low, avail)
            if avail < self.floor:
                self.fired = True
                try:
                    os.killpg(self.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return


# Forks the command and reports its wait4 rusage: a child forked from this (large) process would
# start its ru_maxrss at this process's RSS, which fork and exec carry over.


SPAWN = """import json, os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, ru = os.wait4(pid, 0)
json.dump({"rc": os.waitstatus_to_exitcode(status), "inblock": ru.ru_inblock, "oublock": ru.ru_oublock,
           "maxrss": ru.ru_maxrss}, open(sys.argv[1], "w"))
"""


def parse_ckpt_peak(out, res):
    """fsdp-ckpt export's own peak RSS (VmHWM before exit; its rusage adds the libraries' teardown)."""
    m = re.search(r"^peak RSS: ([0-9.]+) MiB$", out, re.M)
    if m:
        res["peak_rss_bytes"] = [float(m.group(1)) * MIB]


def cpu_bf16_text():
    """Whether this CPU has bf16 matrix instructions, as /proc/cpuinfo lists them."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return "the CPU's flags unknown"
    have = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return ("this CPU has " + " and ".join(have) if have else
            "this CPU has neither avx512_bf16 nor amx_bf16: LibTorch's bf16 matmul takes a slow path")


def run_phase(name, cmd, logs, env, floor, data):
    """Runs cmd in its own process group, `data` evicted from the page cache first: wall, rc, the
    command's rusage, its output."""
    log_path, usage_path = (os.path.join(logs, name + ext) for ext in (".log", ".rusage.json"))
    evict(data)
    say(f"{name}: {' '.join(cmd)}")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-S", "-c", SPAWN, usage_path, *cmd], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        guard = MemoryGuard(p.pid, floor)
        guard.start()
        rc = p.wait()
        guard.done.set()
    wall = time.monotonic() - t0
    out = open(log_path, errors="replace").read()
    usage = json.load(open(usage_path)) if os.path.exists(usage_path) else {"inblock": 0, "oublock": 0, "maxrss": 0}
    rc = usage.get("rc", rc)
    res = {"phase": name, "rc": rc, "wall_s": wall, "read_bytes": usage["inblock"] * 512,
           "write_bytes": usage["oublock"] * 512, "maxrss_bytes": usage["maxrss"] * 1024, "log": log_path,
           "mem_available_low_bytes": guard.low}
    if guard.fired:
        res["error"] = f"killed by the memory guard (MemAvailable < {floor / MIB:.0f} MiB)"
    elif rc != 0:
        res["error"] = "\n".join(out.strip().splitlines()[-6:])
    say(f"{name}: {wall:.1f} s, status {rc}" + (f": {res['error']}" if "error" in res else ""))
    return res, out


def parse_train_log(out, res, metrics, trace):
    """fsdp-train's figures: peak RSS per rank, the plan's total, losses, the save's time."""
    m = re.search(r"peak RSS per rank:((?: [0-9.]+ MiB)+)", out)
    if m:
        res["peak_rss_bytes"] = [float(x) * MIB for x in re.findall(r"([0-9.]+) MiB", m.group(1))]
    # The plan (fsdp/plan.h) as fsdp-train prints it: "memory (RAM) per rank: X MiB", then its items;
    # the disk tier's I/O per step, planned and measured.
    m = re.search(r"^\[rank 0\] memory \(RAM\) per rank: ([0-9.]+) MiB", out, re.M)
    if m:
        res["plan_bytes"] = float(m.group(1)) * MIB
        res["plan_line"] = "memory (RAM) per rank: " + m.group(1) + " MiB"
    # The phases (Note [The load and the save]): the load's and a save's totals, and the plan's peak
    # over them and the step, which a whole process's peak RSS is held to.
    m = re.search(r"^\[rank 0\] the load \((\w+)\) per rank: ([0-9.]+) MiB", out, re.M)
    if m:
        res["plan_load_bytes"], res["plan_load_kind"] = float(m.group(2)) * MIB, m.group(1)
    m = re.search(r"^\[rank 0\] a save per rank: ([0-9.]+) MiB", out, re.M)
    if m:
        res["plan_save_bytes"] = float(m.group(1)) * MIB
    m = re.search(r"^\[rank 0\] peak per rank: ([0-9.]+) MiB, in the (\w+)", out, re.M)
    if m:
        res["plan_peak_bytes"], res["plan_peak_phase"] = float(m.group(1)) * MIB, m.group(2)
    m = re.search(r"^\[rank 0\] an export \(fsdp-ckpt export: one process, not a rank\): ([0-9.]+) MiB", out, re.M)
    if m:
        res["plan_export_bytes"] = float(m.group(1)) * MIB
    m = re.search(r"^\[rank 0\] an adapter export \(fsdp-ckpt export of the adapters alone: one process\): ([0-9.]+) MiB",
                  out, re.M)
    if m:
        res["plan_export_adapter_bytes"] = float(m.group(1)) * MIB
    m = re.search(r"^\[rank 0\] settings: (.*)$", out, re.M)
    if m:
        res["plan_settings"] = m.group(1).strip()
    m = re.search(r"per step per rank: .*disk tier disk read ([0-9.]+) MiB, disk write ([0-9.]+) MiB", out)
    if m:
        res["plan_disk_io_mib"] = [float(m.group(1)), float(m.group(2))]
    m = re.search(r"offload measured \(rank 0, per step after the first\): disk read ([0-9.]+) MiB, disk write ([0-9.]+) MiB",
                  out)
    if m:
        res["measured_disk_io_mib"] = [float(m.group(1)), float(m.group(2))]
    m = re.search(r"init: .*rank 0 read ([0-9.]+) MiB", out)
    if m:
        res["import_rank0_read_bytes"] = float(m.group(1)) * MIB
    if metrics and os.path.exists(metrics):
        lines = [json.loads(x) for x in open(metrics) if x.strip()]
        steps = [x for x in lines if "step" in x and "loss" in x and not x.get("eval")]
        res["steps"] = [{"step": x["step"], "loss": x["loss"], "lr": x["lr"], "step_time_s": x["step_time_s"],
                         "grad_norm": x.get("grad_norm"), "phase_s": x.get("phase_s"),
                         "phase_peak_rss_bytes": x.get("phase_peak_rss_bytes")} for x in steps]
        if "peak_rss_bytes" not in res and lines:
            res["peak_rss_bytes"] = lines[-1]["peak_rss_bytes"]
    saves = []
    for m in re.finditer(r"saved checkpoint \S+/step-0*(\d+) in ([0-9.]+) s \(([0-9.]+) MB, [0-9]+ MB/s\); "
                         r"peak RSS per rank during the save:((?: [0-9.]+ MiB)+)", out):
        saves.append({"step": int(m.group(1)), "seconds": float(m.group(2)), "bytes": float(m.group(3)) * 1e6,
                      "peak_rss_bytes": [float(x) * MIB for x in re.findall(r"([0-9.]+) MiB", m.group(4))]})
    # A save written during its step's optimizer phase (train.save_in_step): the time after the
    # step, the bytes written during it, and that optimizer phase's time.
    for m in re.finditer(r"saved checkpoint \S+/step-0*(\d+) in ([0-9.]+) s after the step \(([0-9.]+) MB, "
                         r"([0-9.]+) MB of it written during step \d+'s optimizer phase, which took ([0-9.]+) s\); "
                         r"peak RSS per rank during the save:((?: [0-9.]+ MiB)+)", out):
        saves.append({"step": int(m.group(1)), "seconds": float(m.group(2)), "bytes": float(m.group(3)) * 1e6,
                      "in_step_bytes": float(m.group(4)) * 1e6, "optimizer_s": float(m.group(5)),
                      "peak_rss_bytes": [float(x) * MIB for x in re.findall(r"([0-9.]+) MiB", m.group(6))]})
    if saves:
        res["save_metrics"] = saves
    if trace and os.path.exists(trace):
        events = json.load(open(trace))["traceEvents"]
        saves = [e["dur"] / 1e6 for e in events if e.get("ph") == "X" and e.get("name") == "train::checkpoint_save"]
        if saves:
            res["save_s"] = sum(saves)
    return res


def compare_logits(ref, other, tol):
    import numpy as np
    a, b = np.load(ref), np.load(other)
    if a.shape != b.shape:
        return {"shapes": [list(a.shape), list(b.shape)], "ok": False}
    diff = float(np.abs(a - b).max())
    top2 = np.sort(a, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * tol  # positions whose argmax no error within tol can flip
    agree = a.argmax(-1) == b.argmax(-1)
    return {"max_abs_diff": diff, "max_abs_logit": float(np.abs(a).max()), "tolerance": tol,
            "argmax_agree": float(agree.mean()), "argmax_agree_where_clear": bool(agree[clear].all()),
            "clear_positions": int(clear.sum()), "positions": int(agree.size),
            "ok": bool(diff <= tol and agree[clear].all())}
