"""Core comparison: perplexity and measured bits/element of every KV format on SmolLM2-135M and WikiText-2.

One forward per window through a fresh cache; attention sees the reconstruction of every token (including the
window's own), the way llama.cpp's perplexity tool measures its quantized caches. Prints Markdown tables and
writes JSON (with the full config) to benchmarks/results/.

    python benchmarks/core_formats.py                      # ~25 min on 2 CPU cores
    python benchmarks/core_formats.py --windows 8 --text path/to/test.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paths import RESULTS, WIKITEXT_TEST

from hf_deltakv.compare import compare_caches, markdown_table, write_json
from hf_deltakv.models import load_model

# One change from the DeltaKVCache default per row (shared with ablation_kld.py).
DELTA_VARIANTS = (
    "delta",
    "delta:delta_format=q4_0",
    "delta:delta_format=q4_0,values=q4_0_16",
    "delta:mean_reference=false",
    "delta:intra=false",
    "delta:pre_rope=false",
    "delta:rotate=false",
    "delta:sink_tokens=0",
    "delta:reference=keyframe",
)
FORMATS = (
    "fp16",
    "q8_0",
    "q4_0",
    "q4_1",
    "q4_0-rot",
    "kivi",
    "kivi-pre-rope",
    *DELTA_VARIANTS,
    "delta:values=delta",
    "delta:values=q4_1",
    "delta:kf=64",
)
GROWTH = ("fp16", "q4_0", "delta:kf=32", "delta:kf=512")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(WIKITEXT_TEST))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--growth-ctx", default="512,4096", help="context lengths of the error-growth check")
    parser.add_argument("--growth-windows", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "core_formats.json"))
    parser.add_argument("--skip-growth", action="store_true")
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    result = compare_caches(model, tokenizer, args.text, FORMATS, (args.ctx,), args.windows, protocols=("one-forward",))
    print(f"## Formats at ctx {args.ctx} ({args.windows} windows)\n")
    print(markdown_table(result))
    if not args.skip_growth:
        growth_ctx = tuple(int(c) for c in args.growth_ctx.split(","))
        growth = compare_caches(
            model, tokenizer, args.text, GROWTH, growth_ctx, args.growth_windows, protocols=("one-forward",)
        )
        print(f"\n## Error growth with context ({args.growth_windows} windows each)\n")
        print(markdown_table(growth))
        result["growth"] = growth
    result["config"]["text"] = Path(args.text).name if Path(args.text).exists() else args.text
    if "growth" in result:
        result["growth"]["config"]["text"] = result["config"]["text"]
    write_json(result, args.out)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
