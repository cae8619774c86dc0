"""Which of two caches decodes faster? Decode steps of several caches interleaved in one process, so that the
machine's drift (10-30 % between runs here) falls on every cache alike.

Each cache is prefilled with the same prompt, then the caches take decoding steps in turn (A, B, A, B, ...), each
fed its own greedy token; every step is timed alone. Reported per cache: the median step time and decode tokens/s
(1 / median; the mean too: a group's coding falls on a few steps), and the ratio to the first cache.
`decode_speed.py` runs each cache in its own process (for its memory figures), where the drift between processes can
exceed the difference between two of our caches.

    python benchmarks/ab_caches.py --caches "delta;delta:kf=64,key_bits=3,values=q3_0,key_ranges=grid8"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from paths import RESULTS, machine


@torch.no_grad()
def measure(specs: list[str], ctx: int, new: int, text: str, dtype: str) -> list[dict]:
    from hf_deltakv.eval.perplexity import cache_bits, kv_elements
    from hf_deltakv.eval.texts import load_text
    from hf_deltakv.kernels.cpu import extension
    from hf_deltakv.models import load_model
    from hf_deltakv.registry import build_cache

    model, tokenizer = load_model(dtype=getattr(torch, dtype))
    ids = tokenizer(load_text(text), return_tensors="pt").input_ids[:, :ctx]
    if ids.shape[1] < ctx:
        raise ValueError(f"{text} has only {ids.shape[1]} tokens, {ctx} asked")
    extension()  # (the CPU kernels built before any timing)
    caches = [build_cache(spec, model) for spec in specs]
    logits = [model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits for cache in caches]
    times: list[list[float]] = [[] for _ in specs]
    for _ in range(new):
        for i, cache in enumerate(caches):
            token = logits[i][:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            logits[i] = model(token, cache=cache, use_cache=True).logits
            times[i].append(time.perf_counter() - start)
    elements = kv_elements(model.config, ctx + new)
    rows = []
    for spec, cache, steps in zip(specs, caches, times, strict=True):
        median = statistics.median(steps[1:])  # (the first step of each cache: warm-up)
        rows.append({"cache": spec, "ctx": ctx, "dtype": dtype, "new": new, "median_step_ms": 1e3 * median,
                     "mean_step_ms": 1e3 * statistics.fmean(steps[1:]),
                     "decode_tokens_per_s": 1 / median, "bits_per_element": cache_bits(cache, elements)[0],
                     "threads": torch.get_num_threads()})  # fmt: skip
    for row in rows:
        row["vs_first"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| cache | ctx | dtype | bits/element | median step (ms) | mean step (ms) | decode tokens/s | vs first |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| `{r['cache']}` | {r['ctx']} | {r['dtype']} | {r['bits_per_element']:.2f} | "
                     f"{r['median_step_ms']:.1f} | {r['mean_step_ms']:.1f} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['vs_first']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", required=True, help="cache specs separated by ';' (the first: the reference)")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64, help="decoding steps per cache")
    parser.add_argument("--text", default="stdlib-code")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(RESULTS / "ab_caches.json"))
    args = parser.parse_args(argv)
    rows = measure(args.caches.split(";"), args.ctx, args.new, args.text, args.dtype)
    print(markdown(rows))
    config = {**vars(args), "date": time.strftime("%F"), "machine": machine()}
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
