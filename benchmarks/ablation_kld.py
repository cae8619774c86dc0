"""How the DeltaKVCache defaults were chosen: KL divergence from the fp16 cache, on the VALIDATION split.

Each row changes one thing from the default, or isolates keys or values by storing the other stream in fp16.
Tuning uses WikiText-2 valid, never test; the reported comparison (core_formats.py) uses test.

    python benchmarks/ablation_kld.py          # ~8 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core_formats import DELTA_VARIANTS
from paths import RESULTS, WIKITEXT_VALID

from hf_deltakv.compare import compare_caches, markdown_table, write_json
from hf_deltakv.models import load_model

VARIANTS = (
    "fp16",
    "q4_0",
    "kivi-pre-rope",
    *DELTA_VARIANTS,
    "delta:kf=64",
    # keys alone (values in fp16), then values alone (keys in fp16)
    "delta:values=f16",
    "delta:values=f16,mean_reference=false",
    "delta:values=f16,delta_format=q4_0",
    "kivi-pre-rope:v_format=f16",
    "q4_0-rot:k_format=f16",
    "q4_0-rot:k_format=f16,v_format=q4_0_16",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(WIKITEXT_VALID))
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--out", default=str(RESULTS / "ablation_kld.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    result = compare_caches(
        model, tokenizer, args.text, VARIANTS, (args.ctx,), args.windows, protocols=("one-forward",)
    )
    result["config"]["text"] = Path(args.text).name
    print(markdown_table(result))
    write_json(result, args.out)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
