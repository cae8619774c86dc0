"""ResidualKVCache side by side with DeltaKVCache, the KIVI-style layout and plain 4-bit, from one run.

SmolLM2-135M, 4 windows of 1024 and of 4096 tokens, one forward per window (every cached token read back as stored),
on WikiText-2 test (prose; the built-in compressor was trained on WikiText-2 valid) and on stdlib code (a text the
compressor never saw). Bits per element are measured from the bytes each cache holds.

    python benchmarks/residual_cache.py                       # ~25 min on 2 CPU cores
    python benchmarks/residual_cache.py --ctx 1024 --texts wikitext2-test --protocols chunked \
        --out benchmarks/results/residual_cache_chunked.json

Writes benchmarks/results/residual_cache.json (results with their config).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paths import RESULTS, WIKITEXT_TEST

from hf_deltakv.compare import compare_caches, markdown_table, write_json
from hf_deltakv.models import load_model

CACHES = ("fp16", "q4_0", "q4_0-rot", "kivi-pre-rope", "delta", "residual")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", default="wikitext2-test,stdlib-code")
    parser.add_argument("--ctx", default="1024,4096")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--protocols", default="one-forward", help="one-forward and/or chunked")
    parser.add_argument("--caches", default=";".join(CACHES))
    parser.add_argument("--wikitext", default=str(WIKITEXT_TEST), help="WikiText-2 test.txt")
    parser.add_argument("--out", default=str(RESULTS / "residual_cache.json"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    caches = tuple(args.caches.split(";"))
    ctx = tuple(int(c) for c in args.ctx.split(","))
    results = []
    for text in args.texts.split(","):
        source = args.wikitext if text == "wikitext2-test" else text
        protocols = tuple(args.protocols.split(","))
        result = compare_caches(model, tokenizer, source, caches, ctx, args.windows, not args.no_progress, protocols)
        result["config"]["text"] = text
        results.append(result)
        print(f"\n## {text}\n\n{markdown_table(result)}", flush=True)
    write_json({"benchmark": "residual_cache", "results": results}, Path(args.out))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
