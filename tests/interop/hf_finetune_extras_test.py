#!/usr/bin/env python3
"""Fine-tuning a Hugging Face model with fsdp-train beyond the plain round trip; one case per run:

VocabResize      a llama made with transformers (vocab 96, tied and untied embeddings) is started from
                 on 2 ranks with model.vocab_size=128: the export (vocab_size 128 in config.json) loads
                 in transformers, the first 96 rows of the embedding and LM head are the original's
                 bit for bit, the 32 new rows are the mean of the original rows (Note [Grown rows]) and
                 within the noise of transformers' own resize_token_embeddings; a few steps of
                 fine-tuning (a resume) move the new rows, and the fine-tuned export's logits equal
                 fsdp-ckpt logits of its checkpoint; a smaller vocab_size is refused with status 2.
ExportTokenizer  fsdp-ckpt export copies tokenizer.json, tokenizer_config.json and generation_config.json
                 from the --init-from directory the checkpoint records (AutoTokenizer loads the export),
                 notes the missing special_tokens_map.json, takes --tokenizer-dir instead when given,
                 refuses a --tokenizer-dir that does not exist before writing anything, and notes a
                 recorded directory that is gone.
LogitsOfHFDir    fsdp-ckpt logits reads a Hugging Face directory (bf16 safetensors in several files) and
                 gives transformers' fp32 logits within 1e-4.

Usage: FSDP_RUN=build/bin/fsdp-run FSDP_TRAIN=build/bin/fsdp-train FSDP_CKPT=build/bin/fsdp-ckpt \\
         hf_finetune_extras_test.py CASE    (the venv's python; ctest sets all three; "N passed, M failed")
"""
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from hf_checks import load_hf, record, run, summary  # noqa: E402

LOGITS_ATOL = 1e-4  # fp32, the same math in two implementations
VOCAB, GROWN = 96, 128
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
TRAIN = ["--set", "data.seq_len=16", "--set", "data.batch_size_per_rank=2", "--set", "train.eval_every=0",
         "--set", "optim.warmup_steps=1", "--set", "optim.lr=1e-2"]


def make_hf(path, tie):
    """A random bf16 llama saved by transformers across several files, weights far from zero."""
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 if name.endswith("norm.weight") else 0) + 0.3 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    return model


def fsdp_train(programs, *args):
    return run([programs["FSDP_RUN"], "--nproc-per-node", "2", "--timeout-s", "100", "--",
                programs["FSDP_TRAIN"], *TRAIN, *args])


def weights(model):
    emb = model.model.embed_tokens.weight.detach()
    return emb, model.lm_head.weight.detach()


def check_grown_rows(label, exported, original, tie):
    """The export against the original: old rows bit for bit, new rows the mean of the old, and within
    the noise of transformers' resize_token_embeddings (N(mean, 1e-9 covariance))."""
    emb, head = weights(exported)
    old_emb, old_head = weights(original)
    record(f"{label}: config.json vocab_size {exported.config.vocab_size}, embedding {list(emb.shape)}",
           exported.config.vocab_size == GROWN and list(emb.shape) == [GROWN, 32] and list(head.shape) == [GROWN, 32])
    same = torch.equal(emb[:VOCAB], old_emb) and torch.equal(head[:VOCAB], old_head)
    record(f"{label}: the first {VOCAB} rows of the embedding and LM head are the original's, bit for bit", same)
    ok = True
    detail = []
    for name, new, old in (("embedding", emb, old_emb), ("lm_head", head, old_head)):
        mean = old.double().mean(0).float()
        diff = float((new[VOCAB:] - mean).abs().max())
        detail.append(f"{name}: new rows - mean of old rows: max {diff:.2e}; |mean| max {float(mean.abs().max()):.3f}")
        ok = ok and diff <= 1e-6 and float(mean.abs().max()) > 1e-2
    record(f"{label}: each of the {GROWN - VOCAB} new rows is the mean of the original rows ({'; '.join(detail)})", ok)
    theirs = LlamaForCausalLM(original.config)
    theirs.load_state_dict(original.state_dict())
    theirs.resize_token_embeddings(GROWN)  # mean_resizing=True, the default
    t_emb, t_head = weights(theirs)
    gap = max(float((t_emb[VOCAB:] - emb[VOCAB:]).abs().max()), float((t_head[VOCAB:] - head[VOCAB:]).abs().max()))
    record(f"{label}: the new rows are within 2e-4 of transformers' resize_token_embeddings' (max {gap:.1e}; "
           f"tied {tie})", gap <= 2e-4)


def logits_match(programs, label, model_dir, ckpt, root):
    """fsdp-ckpt logits of `ckpt` against transformers' on the export `model_dir`, tokens from the whole
    vocabulary (new ids included)."""
    tokens = np.random.default_rng(0).integers(0, GROWN, size=(2, 12)).astype(np.int64)
    tokens[0, :4] = [GROWN - 1, VOCAB, VOCAB + 1, 0]
    tokens_path, logits_path = os.path.join(root, "tokens.npy"), os.path.join(root, "logits.npy")
    np.save(tokens_path, tokens)
    rc, log = run([programs["FSDP_CKPT"], "logits", ckpt, tokens_path, logits_path])
    model, _, _ = load_hf(model_dir, "sdpa", LlamaForCausalLM)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    diff = float(np.abs(np.load(logits_path) - theirs).max()) if rc == 0 else float("inf")
    record(f"{label}: fsdp-ckpt logits of the checkpoint equal transformers' on the export within {LOGITS_ATOL} "
           f"(max abs diff {diff:.1e})", diff <= LOGITS_ATOL, log)


def vocab_case(programs, tmp, tie):
    label = "tied" if tie else "untied"
    root = os.path.join(tmp, label)
    hf, save, out = (os.path.join(root, d) for d in ("hf", "ckpt", "export"))
    original = make_hf(hf, tie)
    original = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)
    rc, log = fsdp_train(programs, "--init-from", hf, "--set", f"model.vocab_size={GROWN}", "--steps", "0",
                         "--save-dir", save)
    grew = f"init: grew model.embed_tokens.weight: {VOCAB} -> {GROWN} rows (model.vocab_size {GROWN} > {VOCAB})"
    record(f"{label}: fsdp-train --init-from with model.vocab_size {GROWN} on 2 ranks (status {rc}) says it grew "
           "the embedding" + ("" if tie else " and the LM head"),
           rc == 0 and grew in log and (tie or "init: grew lm_head.weight" in log), log)
    if rc != 0:
        return
    rc, log = run([programs["FSDP_CKPT"], "export", "--dtype", "float32", save, out])
    record(f"{label}: fsdp-ckpt export (status {rc})", rc == 0, log)
    exported, info, msgs = load_hf(out, "sdpa", LlamaForCausalLM)
    problems = {k: sorted(v) for k, v in info.items() if v}
    record(f"{label}: transformers loads the export with no missing or mismatched keys", not problems, problems)
    check_grown_rows(label, exported, original, tie)

    # Fine-tuning: a resume trains a few steps on tokens of the whole new vocabulary.
    rc, log = fsdp_train(programs, "--init-from", hf, "--set", f"model.vocab_size={GROWN}", "--steps", "3",
                         "--save-dir", save, "--resume", "latest")
    tuned = os.path.join(root, "tuned")
    rc2, log2 = run([programs["FSDP_CKPT"], "export", "--dtype", "float32", save, tuned])
    record(f"{label}: 3 steps of fine-tuning on 2 ranks and export (status {rc}, {rc2})", rc == 0 and rc2 == 0,
           log + log2)
    if rc != 0 or rc2 != 0:
        return
    model, _, _ = load_hf(tuned, "sdpa", LlamaForCausalLM)
    moved = float((weights(model)[0][VOCAB:] - weights(exported)[0][VOCAB:]).abs().max())
    record(f"{label}: fine-tuning moved the new rows (max change {moved:.1e})", moved > 1e-4)
    logits_match(programs, label, tuned, os.path.join(save, "step-00000003"), root)


def vocab_resize(programs, tmp):
    for tie in (True, False):
        vocab_case(programs, tmp, tie)
    hf = os.path.join(tmp, "untied", "hf")
    rc, log = fsdp_train(programs, "--init-from", hf, "--set", "model.vocab_size=64", "--steps", "0")
    want = f"model.vocab_size=64 is smaller than {hf}/config.json's vocab_size {VOCAB}"
    record(f"a smaller model.vocab_size is refused with status 2 naming both sizes (status {rc})",
           rc == 2 and want in log and "the vocabulary can grow" in log, log)


def make_tokenizer(path, vocab):
    """A word-level tokenizer of `vocab` tokens saved with transformers, and a generation config; no
    special_tokens_map.json (an absent file export must skip)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=1, max_new_tokens=7).save_pretrained(path)
    special = os.path.join(path, "special_tokens_map.json")
    if os.path.exists(special):
        os.remove(special)


def export_tokenizer(programs, tmp):
    hf, save = os.path.join(tmp, "hf"), os.path.join(tmp, "ckpt")
    make_hf(hf, tie=False)
    make_tokenizer(hf, VOCAB)
    rc, log = fsdp_train(programs, "--init-from", hf, "--steps", "1", "--save-dir", save)
    state = json.load(open(os.path.join(save, "step-00000001", "train_state.json")))
    record(f"fsdp-train --init-from records the directory in train_state.json (status {rc})",
           rc == 0 and state["extra"]["init_from"]["dir"] == os.path.realpath(hf), log)
    out = os.path.join(tmp, "export")
    rc, log = run([programs["FSDP_CKPT"], "export", save, out])
    names = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    same = rc == 0 and all(open(os.path.join(out, n), "rb").read() == open(os.path.join(hf, n), "rb").read()
                           for n in names)
    record(f"export copies {', '.join(names)} from the --init-from directory (status {rc})", same, log)
    record("export notes the missing special_tokens_map.json and writes none",
           f"note: {os.path.realpath(hf)} has no special_tokens_map.json: skipped" in log
           and not os.path.exists(os.path.join(out, "special_tokens_map.json")), log)
    if same:
        theirs = transformers.AutoTokenizer.from_pretrained(out)
        gen = transformers.GenerationConfig.from_pretrained(out)
        ids = theirs("w5 w17 w95 </s>")["input_ids"]
        record(f"AutoTokenizer and GenerationConfig load from the export ({ids}, eos {theirs.eos_token_id}, "
               f"max_new_tokens {gen.max_new_tokens})",
               ids == [5, 17, 95, 1] and theirs.eos_token_id == 1 and gen.max_new_tokens == 7)

    other = os.path.join(tmp, "other-tokenizer")
    make_tokenizer(other, 50)
    out2 = os.path.join(tmp, "export2")
    rc, log = run([programs["FSDP_CKPT"], "export", "--tokenizer-dir", other, save, out2])
    ok = rc == 0 and open(os.path.join(out2, "tokenizer.json")).read() == open(os.path.join(other, "tokenizer.json")).read()
    record(f"--tokenizer-dir takes the files from that directory instead (status {rc})", ok, log)
    missing = os.path.join(tmp, "no-such-dir")
    out3 = os.path.join(tmp, "export3")
    rc, log = run([programs["FSDP_CKPT"], "export", "--tokenizer-dir", missing, save, out3])
    record(f"a --tokenizer-dir that does not exist is an error (status {rc}) and nothing is written",
           rc == 1 and f"--tokenizer-dir {missing} is not a directory" in log and not os.path.exists(out3), log)
    shutil.move(hf, hf + "-moved")
    out4 = os.path.join(tmp, "export4")
    rc, log = run([programs["FSDP_CKPT"], "export", save, out4])
    record(f"a recorded --init-from directory that is gone: exported without tokenizer files, with a note (status {rc})",
           rc == 0 and "no longer exists: no tokenizer files copied" in log
           and not os.path.exists(os.path.join(out4, "tokenizer.json")), log)


def logits_of_hf_dir(programs, tmp):
    hf = os.path.join(tmp, "hf")
    make_hf(hf, tie=False)
    files = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, 16)).astype(np.int64)
    tokens_path, logits_path = os.path.join(tmp, "tokens.npy"), os.path.join(tmp, "logits.npy")
    np.save(tokens_path, tokens)
    rc, log = run([programs["FSDP_CKPT"], "logits", hf, tokens_path, logits_path])
    record(f"fsdp-ckpt logits reads the Hugging Face directory ({len(files)} bf16 files) (status {rc})",
           rc == 0 and len(files) > 1 and "(LlamaForCausalLM)" in log, log)
    if rc != 0:
        return
    model, _, _ = load_hf(hf, "sdpa", LlamaForCausalLM)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ours = np.load(logits_path)
    diff = float(np.abs(ours - theirs).max())
    record(f"its logits equal transformers' (fp32, sdpa) within {LOGITS_ATOL}: max abs diff {diff:.1e}, "
           f"max |logit| {float(np.abs(theirs).max()):.2f}", ours.shape == theirs.shape and diff <= LOGITS_ATOL)
    rc, log = run([programs["FSDP_CKPT"], "logits", tmp, tokens_path, logits_path])
    record(f"a directory that is neither a checkpoint nor a Hugging Face model is refused (status {rc})",
           rc != 0 and "fsdp-ckpt: error" in log, log)


CASES = {"VocabResize": vocab_resize, "ExportTokenizer": export_tokenizer, "LogitsOfHFDir": logits_of_hf_dir}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print("\n".join(__doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    programs = {var: os.environ.get(var, "") for var in ("FSDP_RUN", "FSDP_TRAIN", "FSDP_CKPT")}
    for var, path in programs.items():
        if not path or not os.access(path, os.X_OK):
            print(f"{var} must name an executable (e.g. {var}=build/bin/...; ctest sets it)", file=sys.stderr)
            return 2
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        CASES[sys.argv[1]](programs, tmp)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
