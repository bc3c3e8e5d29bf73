"""What the bitsandbytes 4-bit checks share (tests/interop/bnb_import_test.py, bench/nf4_check.py):
a transformers "bnb-4bit" save of a bf16 model quantized here by bitsandbytes on the CPU, fsdp's
side of it by tests/interop/bnb_import_tool, and the comparisons against bitsandbytes' own
dequantization and transformers' (+ peft's) logits."""
import json
import os
import subprocess

import numpy as np
import torch


def quantize(bf16_dir, out_dir, quant_type="nf4", double_quant=True):
    """bf16_dir's model loaded with BitsAndBytesConfig(load_in_4bit) on the CPU and saved to out_dir."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                             bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, quantization_config=cfg, device_map="cpu")
    model.save_pretrained(out_dir)


def load_quantized(q_dir, adapter=None):
    """The saved bnb-4bit model as transformers runs it with bitsandbytes on the CPU (its Linear4bit
    with compute_dtype fp32, the other weights fp32); with `adapter`, peft's PeftModel over it.
    bitsandbytes repacks a CPU Linear4bit's codes at its first forward: read them (bnb_reference)
    before running it."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(q_dir, device_map="cpu", dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.compute_dtype = torch.float32
        for k, p in list(m.named_parameters(recurse=False)):
            if p.dtype == torch.bfloat16:  # transformers keeps a quantized model's other weights in bf16
                setattr(m, k, torch.nn.Parameter(p.data.float(), requires_grad=False))
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def dequantized_model(q_dir, adapter=None):
    """The same model as a plain fp32 transformers model, each 4-bit weight replaced by
    bitsandbytes' dequantize_4bit of it into fp32 (the values fsdp's NF4 decode must give)."""
    import copy
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM
    quant = AutoModelForCausalLM.from_pretrained(q_dir, device_map="cpu")
    cfg = AutoConfig.from_pretrained(q_dir)
    delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {}
    for name, m in quant.named_modules():
        for k, p in m.named_parameters(recurse=False):
            state[f"{name}.{k}"] = p.data.float()
        if isinstance(m, bnb.nn.Linear4bit):
            qs = copy.copy(m.weight.quant_state)
            qs.dtype = torch.float32
            state[f"{name}.weight"] = F.dequantize_4bit(m.weight.data, qs)
    model.load_state_dict(state, strict=False)
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def logits_of(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens).view(1, -1)).logits[0].float().numpy()


def run_tool(tool, q_dir, tokens, prefix, r=4, alpha=8.0, adapter=None, timeout=600):
    """bnb_import_tool on q_dir: (exit status, output, its JSON, its bytes)."""
    tokens.astype("<i8").tofile(prefix + ".tokens")
    cmd = [tool, q_dir, prefix + ".tokens", prefix, str(r), str(alpha)] + ([adapter] if adapter else [])
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode != 0:
        return p.returncode, p.stdout, None, None
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    with open(prefix + ".json") as f:
        return 0, p.stdout, json.load(f), data


def part(data, where, dtype):
    return np.frombuffer(data, dtype=dtype, count=where[1] // np.dtype(dtype).itemsize, offset=where[0])


def tool_logits(doc, data):
    return part(data, doc["logits"], np.float32).reshape(-1, doc["logits"][2])


def bnb_reference(model, q_dir):
    """Per 4-bit weight of the transformers model: its packed codes as bitsandbytes saved them in
    q_dir, its absmax as bitsandbytes decodes it, and bitsandbytes' dequantization in fp32 and in
    the state's own dtype (bf16)."""
    import copy
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from safetensors.torch import load_file
    saved = load_file(os.path.join(q_dir, "model.safetensors"))
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, bnb.nn.Linear4bit):
            continue
        w = m.weight
        qs = w.quant_state
        absmax = qs.absmax
        if qs.nested:
            absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
        fp32 = copy.copy(qs)
        fp32.dtype = torch.float32
        key = name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"
        out[key] = {
            "codes": saved[key].view(torch.uint8).reshape(-1).numpy(),
            "absmax": absmax.float().numpy(),
            "fp32": F.dequantize_4bit(w.data, fp32).reshape(-1).numpy(),
            "native": F.dequantize_4bit(w.data, qs).reshape(-1),
        }
    return out


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def compare_weights(doc, data, ref):
    """(failures, count): each of fsdp's NF4 weights against bitsandbytes', bit for bit: the codes,
    the absmax, the decoded values in fp32, and the same rounded to bitsandbytes' own dtype."""
    bad = []
    for name, r in ref.items():
        w = doc["weights"].get(name)
        if w is None:
            bad.append(f"{name}: fsdp holds no NF4 weight of that name")
            continue
        codes, absmax = part(data, w["codes"], np.uint8), part(data, w["absmax"], np.float32)
        decoded = part(data, w["decoded"], np.float32)
        native = torch.from_numpy(decoded.copy()).to(r["native"].dtype)
        checks = [("codes", np.array_equal(codes, r["codes"])),
                  ("absmax", np.array_equal(absmax.view(np.uint32), r["absmax"].view(np.uint32))),
                  ("decoded fp32", np.array_equal(decoded.view(np.uint32), r["fp32"].view(np.uint32))),
                  (f"decoded {r['native'].dtype}", torch.equal(bits(native), bits(r["native"])))]
        bad += [f"{name}: {what} differ" for what, ok in checks if not ok]
    return bad, len(ref)


def random_adapter(base_dir, out_dir, r, alpha, seed=1):
    """A peft LoRA adapter on the seven projections with random A and B (B not zero), saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(out_dir)
    return out_dir


def edit_quant_state(q_dir, name, **changes):
    """Rewrites the quant_state JSON of `name` in q_dir's model.safetensors (a file made here)."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(q_dir, "model.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if k.startswith(name + ".quant_state."))
    state = json.loads(bytes(tensors[key].numpy()).decode())
    state.update(changes)
    tensors[key] = torch.frombuffer(bytearray(json.dumps(state).encode()), dtype=torch.uint8)
    save_file(tensors, path, metadata={"format": "pt"})


def read_dir(hf_dir):
    """Every tensor of a Hugging Face directory's safetensors files, by name (numpy)."""
    import glob
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        out.update(load_file(f))
    return out
