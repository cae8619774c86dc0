"""Bytes held on Gemma-3-270M (5 of every 6 layers sliding-window 512) right after the prefill, before any decoding
step, at 4K and 32K tokens: DeltaKVCache (with and without `model=`, which tells it the layer types) beside
transformers' DynamicCache, which keeps only the window on sliding layers, in fp32 and as fp16. The model runs on
random token ids (bytes do not depend on the text). The 4K prompt is one forward (one-shot); the 32K one is fed
`STEP` tokens at a time (a one-shot 32K forward's attention scores alone would take ~16 GB on the CPU).

    python benchmarks/sliding_memory.py                  # ~10 min on 2 CPU cores
    python benchmarks/sliding_memory.py --lengths 4096   # ~1 min
"""

from __future__ import annotations

import json
import sys

import torch
from paths import RESULTS, cache_bytes, fp16_bytes, reachable_bytes
from transformers import DynamicCache

from hf_deltakv import DeltaKVCache
from hf_deltakv.models import load_model

LENGTHS = (4096, 32768)
STEP = 2048  # tokens per update (a chunked prefill)


ONE_SHOT_UP_TO = 4096  # prompts up to this length are prefilled in one forward


@torch.no_grad()
def fill(model, cache, tokens: int) -> None:
    """The prefill only: what a cache holds before the first decoding step is the peak a prompt must fit in."""
    ids = torch.randint(10, 20_000, (1, tokens), generator=torch.Generator().manual_seed(0))
    step = tokens if tokens <= ONE_SHOT_UP_TO else STEP
    for start in range(0, tokens, step):
        model(ids[:, start : start + step], cache=cache, use_cache=True, logits_to_keep=1)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = parser.parse_args()
    model, _ = load_model("gemma3-270m")
    config = model.config
    rows = []
    for tokens in map(int, args.lengths.split(",")):
        caches = {
            "DynamicCache (fp32)": DynamicCache(config=config),
            "DeltaKVCache(model=model)": DeltaKVCache(model=model),
            "DeltaKVCache() (no model: every layer keeps its history)": DeltaKVCache(),
        }
        for name, cache in caches.items():
            fill(model, cache, tokens)
            prefill = "one-shot" if tokens <= ONE_SHOT_UP_TO else f"{STEP} tokens per forward"
            rows.append({"cache": name, "tokens": tokens, "prefill": prefill, "bytes": cache_bytes(cache)})
            if hasattr(cache, "nbytes"):  # nbytes() against a walk over every tensor the cache holds
                rows[-1]["reachable_bytes"] = reachable_bytes(cache)
            print(f"  {name} @ {tokens}: {rows[-1]['bytes'] / 2**20:.2f} MiB", file=sys.stderr, flush=True)
        dynamic_fp16 = {**rows[-3], "cache": "DynamicCache as fp16", "bytes": fp16_bytes(caches["DynamicCache (fp32)"])}
        rows.insert(len(rows) - 2, dynamic_fp16)
    print("| cache | tokens | MiB held | vs DynamicCache fp16 |\n|---|---:|---:|---:|")
    for row in rows:
        fp16 = next(r["bytes"] for r in rows if r["tokens"] == row["tokens"] and r["cache"] == "DynamicCache as fp16")
        print(f"| {row['cache']} | {row['tokens']} | {row['bytes'] / 2**20:.2f} | {row['bytes'] / fp16:.2f}x |")
    out = RESULTS / "sliding_memory.json"
    measured = {row["tokens"] for row in rows}
    if out.exists():  # lengths measured by an earlier run stay (one length at a time fits a short session)
        rows = [row for row in json.loads(out.read_text())["rows"] if row["tokens"] not in measured] + rows
    config = {"model": "gemma3-270m", "step": STEP, "one_shot_up_to": ONE_SHOT_UP_TO,
              "measured": "after the prefill, before any decoding step"}  # fmt: skip
    out.write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
