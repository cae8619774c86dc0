"""Quality of every cache on both real models (SmolLM2-135M-Instruct and Gemma-3-270M): perplexity, KL divergence
and top-1 agreement against the fp16 cache, with the bits each cache really holds, one forward per window.

Writes benchmarks/results/quality.json (one `compare_caches` result per model) and prints the tables; the README's
summary table and docs/results.md are rendered from it by readme_tables.py.

    python benchmarks/quality.py                         # 4 windows of 1024 tokens of WikiText-2 test: ~25 min
    python benchmarks/quality.py --models smollm2-135m --windows 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paths import RESULTS, WIKITEXT_TEST

from hf_deltakv.compare import compare_caches, markdown_table
from hf_deltakv.models import load_model

CACHES = ("fp16", "delta", "delta-no-model", "delta:keys=token", "kivi-pre-rope", "q4_0-rot", "q4_0", "q8_0")


def compare_on_models(
    models: list[str], caches: list[str], text: str, ctx: int, windows: int, out: Path | None = None
) -> dict:
    """`compare_caches` (one forward per window) for each model, printed as it goes: {model name: result}; written
    to `out` after each model (a long run stopped midway keeps the models it finished)."""
    results = {}
    for name in models:
        model, tokenizer = load_model(name)
        result = compare_caches(
            model, tokenizer, text=text, caches=tuple(caches), ctx=(ctx,), windows=windows, progress=False,
            protocols=("one-forward",),
        )  # fmt: skip
        result["config"]["model_key"] = name
        result["config"]["text"] = Path(text).name
        results[name] = result
        print(f"\n{name}\n{markdown_table(result)}", flush=True)
        if out is not None:
            Path(out).write_text(json.dumps(results, indent=2) + "\n")
    return results


def comparison_main(
    argv: list[str] | None,
    description: str,
    caches: list[str],
    text: str,
    out: Path,
    separator: str = ",",
    models: str = "smollm2-135m,gemma3-270m",
) -> int:
    """The command line shared by this script, ablation_kld.py and bit_tradeoff.py: `caches` on `models` (both real
    models unless told), written to `out`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default=models)
    parser.add_argument("--caches", default=separator.join(caches), help=f"cache specs separated by {separator!r}")
    parser.add_argument("--text", default=str(text))
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--out", default=str(out))
    args = parser.parse_args(argv)
    compare_on_models(args.models.split(","), args.caches.split(separator), args.text, args.ctx, args.windows, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return comparison_main(argv, __doc__.split("\n\n")[0], CACHES, WIKITEXT_TEST, RESULTS / "quality.json")


if __name__ == "__main__":
    sys.exit(main())
