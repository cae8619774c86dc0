"""The seed's claims, measured: four tables on SmolLM2-135M and WikiText-2 test (stdlib code for table c).

The seed (Llama-3.1-70B, WikiText-2, ctx 512) claimed q4_0 +5.61 %, Delta-KV kf=32 +0.26 %, q8_0 -0.19 %, stable
from 512 to 16K tokens and 0.05-0.12 % on code, from code that never compressed its cache. Here every cache
really stores what it says, and bits/element are measured.

    (a) fp16 / q8_0 / q4_0 / delta kf in {16, 32, 64} (and anchors) at ctx 512, both protocols
    (b) context sweep 512 ... 8192
    (c) code (stdlib sources) vs prose (WikiText-2)
    (d) kf sweep 8 ... 512

    python benchmarks/seed_tables.py                 # all four, ~1 h on 2 CPU cores
    python benchmarks/seed_tables.py --tables a,d    # some of them

Each table is written to benchmarks/results/seed_<table>.json with its full config as soon as it is done.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paths import RESULTS, WIKITEXT_TEST

from hf_deltakv.compare import compare_caches, markdown_table, write_json
from hf_deltakv.models import load_model
from hf_deltakv.registry import CACHES

# table: (caches, texts, ctx, windows, protocols)
TABLES = {
    "a": (
        ("fp16", "q8_0", "q4_0", "q4_0-rot", "kivi-pre-rope", "delta:kf=16", "delta:kf=32", "delta:kf=64", "hf-hqq"),
        ("wikitext2-test",),
        (512,),
        16,
        ("one-forward", "chunked"),
    ),
    "b": (
        ("fp16", "q8_0", "q4_0", "delta:kf=32"),
        ("wikitext2-test",),
        (512, 1024, 2048, 4096, 8192),
        4,
        ("one-forward",),
    ),
    "c": (("fp16", "q8_0", "q4_0", "delta:kf=32"), ("stdlib-code", "wikitext2-test"), (1024,), 8, ("one-forward",)),
    "d": (
        ("fp16", *(f"delta:kf={kf}" for kf in (8, 16, 32, 64, 128, 256, 512))),
        ("wikitext2-test",),
        (2048,),
        8,
        ("one-forward",),
    ),
}


def run_table(name: str, model, tokenizer, wikitext: Path, progress: bool) -> dict:
    caches, texts, ctx, windows, protocols = TABLES[name]
    caches = tuple(c for c in caches if CACHES[c.partition(":")[0]].available())
    results = []
    for text in texts:
        source = str(wikitext) if text == "wikitext2-test" else text
        result = compare_caches(model, tokenizer, source, caches, ctx, windows, progress, protocols)
        result["config"]["text"] = text
        results.append(result)
    return {"table": name, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="a,b,c,d")
    parser.add_argument("--text", default=str(WIKITEXT_TEST), help="WikiText-2 test.txt")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    for name in args.tables.split(","):
        table = run_table(name, model, tokenizer, Path(args.text), not args.no_progress)
        for result in table["results"]:
            print(f"\n## Table ({name}): {result['config']['text']}\n")
            print(markdown_table(result))
        out = Path(args.out_dir) / f"seed_{name}.json"
        write_json(table, out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
