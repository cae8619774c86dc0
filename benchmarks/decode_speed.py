"""Decode speed on the CPU: tokens/s after a prompt, per cache, measured in one run (ratios only are meaningful).

python benchmarks/decode_speed.py --ctx 1024 --new 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hf_deltakv.eval.texts import load_text
from hf_deltakv.models import load_model
from hf_deltakv.registry import build_cache

HERE = Path(__file__).resolve().parent
CACHES = ("dynamic", "q4_0", "kivi-pre-rope", "delta")


@torch.no_grad()
def decode_rate(model, ids: torch.Tensor, spec: str, new: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s): the prefill-only run is subtracted from a run generating `new` more."""
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, cache=build_cache(spec, model))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False, cache=build_cache(spec, model))
    return prefill, new / (time.perf_counter() - start - prefill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--text", default="python-docs")
    parser.add_argument("--out", default=str(HERE / "results" / "decode_speed.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[:, : args.ctx]
    rows = []
    for spec in CACHES:
        prefill, rate = decode_rate(model, ids, spec, args.new)
        rows.append({"cache": spec, "prefill_s": prefill, "decode_tokens_per_s": rate})
    base = rows[0]["decode_tokens_per_s"]
    print(f"| cache | prefill of {args.ctx} (s) | decode tokens/s | vs dynamic |")
    print("|---|---:|---:|---:|")
    for row in rows:
        row["vs_dynamic"] = row["decode_tokens_per_s"] / base
        print(
            f"| {row['cache']} | {row['prefill_s']:.2f} | {row['decode_tokens_per_s']:.1f} | {row['vs_dynamic']:.2f}x |"
        )
    config = {"ctx": args.ctx, "new": args.new, "text": args.text, "threads": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
