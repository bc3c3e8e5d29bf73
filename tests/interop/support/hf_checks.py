"""What the Hugging Face interop tests (tests/interop/hf_interop_test.py, hf_families_test.py,
hf_finetune_extras_test.py) share: PASS/FAIL records with a final count, running a program, and
loading a model with transformers while keeping every warning it logs."""
import io
import logging
import subprocess
import warnings

import torch
import transformers

passed = 0
failed = 0


def record(name, ok, detail=""):
    """Prints PASS/FAIL for one check; a failure shows the last lines of `detail`."""
    global passed, failed
    print(("PASS: " if ok else "FAIL: ") + name, flush=True)
    if ok:
        passed += 1
    else:
        failed += 1
        for line in str(detail).splitlines()[-25:]:
            print("    | " + line)


def summary():
    """Prints "N passed, M failed"; the process exit status (1 when any check failed)."""
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def run(cmd, timeout=120):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout


def load_hf(path, attn_implementation, model_class=transformers.AutoModelForCausalLM):
    """from_pretrained in fp32: the model in eval mode, its loading info, and every transformers log
    record and Python warning it produced."""
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.WARNING)
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = model_class.from_pretrained(path, dtype=torch.float32,
                                                      attn_implementation=attn_implementation,
                                                      output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    msgs = [m for m in log.getvalue().splitlines() if m.strip()]
    msgs += ["%s: %s" % (w.category.__name__, w.message) for w in caught]
    return model.eval(), info, msgs
