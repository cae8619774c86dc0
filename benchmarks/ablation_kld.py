"""How DeltaKVCache's defaults were chosen: KL divergence from the fp16 cache on the VALIDATION split of WikiText-2,
on both real models. Each row changes one thing from the default, or isolates keys or values by storing the other
stream in fp16. Tuning uses valid, never test; the reported comparison (quality.py) uses test.

    python benchmarks/ablation_kld.py                     # both models, 4 windows of 1024 tokens: ~40 min
    python benchmarks/ablation_kld.py --models smollm2-135m --windows 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paths import RESULTS, WIKITEXT_VALID
from quality import compare_on_models

VARIANTS = (
    "fp16",
    "delta",
    "kivi-pre-rope",
    "delta:keys=token",  # the earlier per-token delta keys
    "delta:sink_tokens=0",
    "delta:search_scale=false",
    "delta:rotate=false",
    "delta-no-model",  # keys after RoPE
    # keys alone (values in fp16): the per-channel key codec's choices against KIVI's per-channel 4 bits
    "delta:values=f16",
    "delta:values=f16,query_weights=false",
    "delta:values=f16,keys=token",
    "kivi-pre-rope:v_format=f16",
    # values alone (keys in fp16)
    "q4_0-rot:k_format=f16",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--caches", default=";".join(VARIANTS), help="cache specs separated by ';'")
    parser.add_argument("--text", default=str(WIKITEXT_VALID))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--out", default=str(RESULTS / "ablation_kld.json"))
    args = parser.parse_args(argv)
    results = compare_on_models(args.models.split(","), args.caches.split(";"), args.text, args.ctx, args.windows)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
