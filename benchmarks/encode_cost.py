"""What the clipped-range search of DeltaKVCache's key encoder costs: prefill and decode tokens/s with
`clip_range=True` (the default) and `False`, in one process, alternating, median over rounds (SmolLM2, fp32).

The search runs where keys are coded: over every group of a prefill, and once per `kf` decoded tokens per layer.

    python benchmarks/encode_cost.py                     # 4K-token prompt, 32 decoded tokens, 3 rounds: ~3 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from paths import RESULTS, WIKITEXT_TEST, machine

from hf_deltakv import DeltaKVCache
from hf_deltakv.models import load_model


@torch.no_grad()
def run(model, ids: torch.Tensor, new: int, clip_range: bool) -> tuple[float, float]:
    """Prefill and decode tokens/s through a fresh `DeltaKVCache(model=model, clip_range=...)`."""
    cache = DeltaKVCache(model=model, clip_range=clip_range)
    start = time.perf_counter()
    token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
    prefill = ids.shape[1] / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(new):
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    return prefill, new / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "encode_cost.json"))
    args = parser.parse_args(argv)
    model, tokenizer = load_model()
    ids = tokenizer(WIKITEXT_TEST.read_text()[: 40 * args.ctx], return_tensors="pt").input_ids[:, : args.ctx]
    runs = {True: [], False: []}
    for _ in range(args.rounds):
        for clip in runs:
            runs[clip].append(run(model, ids, args.new, clip))
    rows = []
    for clip, measured in runs.items():
        prefill, decode = (statistics.median(m[i] for m in measured) for i in (0, 1))
        rows.append({"clip_range": clip, "prefill_tok_s": prefill, "decode_tok_s": decode})
    on, off = rows
    print("| clip_range | prefill tok/s | decode tok/s |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row['clip_range']} | {row['prefill_tok_s']:.1f} | {row['decode_tok_s']:.2f} |")
    print(f"ratios (on / off): prefill {on['prefill_tok_s'] / off['prefill_tok_s']:.3f}, "
          f"decode {on['decode_tok_s'] / off['decode_tok_s']:.3f}")  # fmt: skip
    config = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "ctx": args.ctx, "new": args.new,
              "rounds": args.rounds, "threads": torch.get_num_threads(), "machine": machine()}  # fmt: skip
    with open(args.out, "w") as out:
        json.dump({"config": config, "rows": rows}, out, indent=2)
        out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
