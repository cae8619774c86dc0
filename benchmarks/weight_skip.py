"""Weight skip on SmolLM2-135M: blocks skipped, decode speed and quality for a sweep of thresholds.

For each threshold (relative rule, see `hf_deltakv/weight_skip.py`):
- decode tokens/s after a prompt, with and without weight skip, measured in this one run (alternating runs, best
  of `--repeats`), and the fraction of weight blocks skipped;
- perplexity and KL divergence against the plain model, on WikiText-2 test fed one token at a time (weight skip acts
  only on decode-shaped inputs, so a one-pass perplexity would not see it).

Writes benchmarks/results/weight_skip.json and weight_skip.png.

    python benchmarks/weight_skip.py                  # ~15 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from paths import RESULTS, WIKITEXT_TEST

from hf_deltakv.eval.perplexity import perplexity, token_windows
from hf_deltakv.eval.texts import load_text
from hf_deltakv.models import load_model
from hf_deltakv.weight_skip import enable_weight_skip

THRESHOLDS = (0.0, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03)


@torch.no_grad()
def decode_rate(model, ids: torch.Tensor, new: int) -> float:
    """Greedy decode tokens/s after prefilling `ids` (the prefill is not timed)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    start = time.perf_counter()
    for _ in range(new):
        logits = model(logits[:, -1].argmax(-1, keepdim=True), cache=cache, use_cache=True).logits
    return new / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(WIKITEXT_TEST))
    parser.add_argument("--thresholds", default=",".join(str(t) for t in THRESHOLDS))
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=256, help="tokens per perplexity window (fed one at a time)")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens before timed decoding")
    parser.add_argument("--new", type=int, default=48, help="tokens decoded per timing run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "weight_skip.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[0]
    windows = token_windows(ids, args.ctx, args.windows)
    prompt = ids[None, -args.prompt :]
    token_by_token = {"protocol": "chunked", "prefix": 1, "chunk": 1}
    reference = perplexity(model, windows, keep_logprobs=True, **token_by_token)
    rows = []
    for threshold in (float(t) for t in args.thresholds.split(",")):
        plain, skipping = [], []
        for _ in range(args.repeats):  # alternate, so that drift on a noisy machine hits both alike
            plain.append(decode_rate(model, prompt, args.new))
            with enable_weight_skip(model, threshold=threshold, block_size=args.block_size):
                skipping.append(decode_rate(model, prompt, args.new))
        with enable_weight_skip(model, threshold=threshold, block_size=args.block_size) as handle:
            quality = perplexity(model, windows, reference=reference.logprobs, **token_by_token)
        stats = handle.stats()["total"]
        rows.append(
            {
                "threshold": threshold,
                "skipped_fraction": stats["skipped_fraction"],
                "read_fraction": stats["blocks_read"] / max(stats["blocks_seen"], 1),
                "plain_tokens_per_s": max(plain),
                "skip_tokens_per_s": max(skipping),
                "speed_ratio": max(skipping) / max(plain),
                "perplexity": quality.perplexity,
                "delta_pct": 100 * (quality.perplexity / reference.perplexity - 1),
                "kl_divergence": quality.kl_divergence,
                "top1_agreement": quality.top1_agreement,
            }
        )
        print(f"  threshold {threshold}: {rows[-1]}", file=sys.stderr)
    print(f"plain model perplexity {reference.perplexity:.4f} ({reference.tokens} tokens fed one at a time)\n")
    print(markdown(rows))
    config = {**vars(args), "text": Path(args.text).name, "reference_perplexity": reference.perplexity}
    config["threads"] = torch.get_num_threads()
    config["date"] = time.strftime("%F")
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    plot(rows, Path(args.out).with_suffix(".png"))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def markdown(rows: list[dict]) -> str:
    lines = [
        "| threshold | blocks skipped | weights read | decode tok/s plain | with skip | ratio | perplexity Δ | KL div. "
        "| top-1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['threshold']} | {100 * r['skipped_fraction']:.2f} % | {100 * r['read_fraction']:.1f} % "
            f"| {r['plain_tokens_per_s']:.1f} "
            f"| {r['skip_tokens_per_s']:.1f} | {r['speed_ratio']:.2f}x | {r['delta_pct']:+.3f} % "
            f"| {r['kl_divergence']:.5f} | {100 * r['top1_agreement']:.2f} % |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    skipped = [100 * r["skipped_fraction"] for r in rows]
    left.plot(skipped, [r["speed_ratio"] for r in rows], marker="o")
    left.axhline(1.0, color="grey", linewidth=0.5)
    left.set_xlabel("weight blocks skipped (%)")
    left.set_ylabel("decode tokens/s vs plain")
    right.plot(skipped, [r["delta_pct"] for r in rows], marker="o")
    right.axhline(0.1, color="red", linewidth=0.5, linestyle="--")
    right.set_xlabel("weight blocks skipped (%)")
    right.set_ylabel("perplexity Δ (%)")
    for r, s in zip(rows, skipped, strict=True):
        right.annotate(str(r["threshold"]), (s, r["delta_pct"]), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
