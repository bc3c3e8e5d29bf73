"""Table of bench_core runs: counted bytes and memory against the ZeRO-3 formulas."""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()
    runs = [json.loads(line) for line in open(args.jsonl) if line.strip()]
    mib = lambda b: b / 2**20
    lines = [
        "Llama (bench_core defaults), FULL_SHARD, fp32, AdamW; figures per rank (rank 0; all ranks agree).",
        "",
        "| N | root reshards after fwd | Psi | sent/step (AG+RS) | 3*Psi*4*(N-1)/N | ratio | model state | 16*Psi/N | ratio | peak gathered | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        r0 = r["ranks"][0]
        sent = r0["all_gather_bytes"] + r0["reduce_scatter_bytes"]
        formula = r["zero3_bytes_per_step"]
        ratio = f"{sent / formula:.4f}" if formula else "n/a (N=1)"
        lines.append(
            f"| {r['world_size']} | {'yes' if r['root_reshard_after_forward'] else 'no (default)'} | {r['psi']:,}"
            f" | {mib(sent):.2f} MiB | {mib(formula):.2f} MiB | {ratio} | {mib(r0['model_state_bytes']):.2f} MiB"
            f" | {mib(r['zero3_model_state_bytes']):.2f} MiB | {r0['model_state_bytes'] / r['zero3_model_state_bytes']:.4f}"
            f" | {mib(r0['peak_unsharded_bytes']):.2f} MiB | {mib(r0['peak_rss_bytes']):.0f} MiB |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
