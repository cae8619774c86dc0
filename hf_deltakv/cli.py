"""`hf-deltakv` command line: `hf-deltakv ppl ...` compares caches side by side."""

from __future__ import annotations

import argparse
import sys

from .registry import CACHES


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def build_parser() -> argparse.ArgumentParser:
    from .eval.compare import DEFAULT_CACHES
    from .eval.texts import BUILTIN_TEXTS

    parser = argparse.ArgumentParser(prog="hf-deltakv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of several KV caches side by side")
    ppl.add_argument("--model", default=None, help="hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    ppl.add_argument("--text", default="python-docs", help=f"one of {BUILTIN_TEXTS} or a text file path")
    ppl.add_argument("--ctx", type=_ints, default=(1024,), help="context lengths, comma-separated (default 1024)")
    ppl.add_argument("--windows", type=int, default=4, help="windows of ctx tokens per measurement (default 4)")
    ppl.add_argument(
        "--caches",
        default=",".join(DEFAULT_CACHES),
        help=f"cache specs separated by ';' or ',' (first one is the reference); names: {sorted(CACHES)}; "
        "parameters after ':' e.g. 'delta:kf=64'",
    )
    ppl.add_argument("--json", default=None, help="write the full result and config here")
    ppl.add_argument("--no-progress", action="store_true")
    return parser


def split_specs(text: str) -> tuple[str, ...]:
    """Specs are separated by ';', or by ',' where the next item is a cache name (not a key=value parameter)."""
    if ";" in text:
        return tuple(s.strip() for s in text.split(";") if s.strip())
    specs: list[str] = []
    for item in text.split(","):
        item = item.strip()
        if specs and "=" in item and item.split(":")[0] not in CACHES:
            specs[-1] += "," + item
        elif item:
            specs.append(item)
    return tuple(specs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "ppl":
        from .eval.compare import compare_caches, markdown_table, write_json
        from .models import load_model

        model, tokenizer = load_model(args.model)
        result = compare_caches(
            model, tokenizer, args.text, split_specs(args.caches), args.ctx, args.windows, not args.no_progress
        )
        print(markdown_table(result))
        if args.json:
            write_json(result, args.json)
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
