#!/usr/bin/env python3
"""same_losses.py REF.jsonl RUN.jsonl [LAST_STEP]: every training-step line of RUN (fsdp-train
--metrics; a step recomputed after a restart appears twice) has exactly REF's loss for that step,
bit for bit; RUN's steps cover 1..LAST_STEP (default: REF's last) without a gap. Exit 1 naming the
first difference."""
import json
import sys


def steps(path):
    out = []
    for line in open(path):
        j = json.loads(line)
        if not j.get("eval") and "step" in j:
            out.append((j["step"], j["loss"]))
    return out


ref = dict(steps(sys.argv[1]))
run = steps(sys.argv[2])
last = int(sys.argv[3]) if len(sys.argv) > 3 else max(ref)
if not run:
    sys.exit("no steps in " + sys.argv[2])
for step, loss in run:
    if step not in ref:
        sys.exit("step %d of %s is not in %s" % (step, sys.argv[2], sys.argv[1]))
    if loss != ref[step]:
        sys.exit("step %d: loss %r, uninterrupted %r" % (step, loss, ref[step]))
missing = sorted(set(range(1, last + 1)) - {s for s, _ in run})
if missing:
    sys.exit("steps missing from %s: %s" % (sys.argv[2], missing[:10]))
print("%d step lines (%d distinct, up to step %d) equal the uninterrupted run bit for bit"
      % (len(run), len({s for s, _ in run}), last))
