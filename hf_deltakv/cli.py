"""`hf-deltakv` command line: `ppl` compares caches side by side; `train-residual` trains a residual compressor."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from .registry import CACHES


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2, before any computation."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from err
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _check_text(source: str) -> None:
    """A built-in text name or a readable UTF-8 text file."""
    from .eval.texts import BUILTIN_TEXTS

    for part in source.split("+"):
        if part in BUILTIN_TEXTS:
            continue
        path = Path(part)
        if not path.is_file():
            raise UsageError(f"--text {part!r}: not one of {BUILTIN_TEXTS} and not a file")
        try:
            with path.open(encoding="utf-8") as handle:
                handle.read(1 << 20)
        except UnicodeDecodeError as err:
            raise UsageError(f"--text {part!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _check_out_folder(out: Path, files: tuple[str, ...], overwrite: bool, own: tuple[str, ...] = ()) -> None:
    """`out` can be written, and holds none of `files` unless `overwrite` or it is in `own` (what an earlier run of
    the same command wrote there, unchanged since): checked before any computation."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".hf-deltakv-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--out {out} cannot be written: {err.strerror or err}") from None
    existing = [name for name in files if (out / name).exists() and name not in own]
    if existing and not overwrite:
        raise UsageError(
            f"--out {out} already holds {', '.join(existing)}, not written by an earlier `hf-deltakv ppl` (or changed "
            "since); pass --overwrite or another --out"
        )


def build_parser() -> argparse.ArgumentParser:
    from .compare import FULL, QUICK
    from .eval.perplexity import CHUNK, PROTOCOLS
    from .eval.texts import BUILTIN_TEXTS, DEFAULT_TEXT

    parser = argparse.ArgumentParser(prog="hf-deltakv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    names = "\n".join(f"  {name:15s} {entry.description}" for name, entry in CACHES.items())
    ppl = sub.add_parser(
        "ppl",
        help="perplexity of several KV caches side by side",
        epilog=f"caches:\n{names}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ppl.add_argument("--model", default=None, help="hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    ppl.add_argument("--text", default=DEFAULT_TEXT, help=f"one of {BUILTIN_TEXTS} or a text file path")
    ppl.add_argument(
        "--full",
        action="store_true",
        help=f"the full comparison: both protocols, {FULL.windows} windows, every default cache with transformers' "
        "QuantizedCache (~15-25 min on 2 CPU cores); without it, a quick one (one forward per window, "
        f"{QUICK.windows} windows, our caches beside q8_0, q4_0 and KIVI's layout: ~1 min). The options below "
        "override either",
    )
    ppl.add_argument("--ctx", type=_ints, default=None, help=f"context lengths, comma-separated (default {QUICK.ctx})")
    ppl.add_argument(
        "--windows",
        type=_at_least(1),
        default=None,
        help=f"windows of ctx tokens per measurement (default {QUICK.windows}; --full: {FULL.windows})",
    )
    ppl.add_argument(
        "--caches",
        default=None,
        help="cache specs separated by ';' or ',' (the first one is the reference), parameters after ':' e.g. "
        f"'delta:kf=64' (default {','.join(QUICK.caches)} and residual; --full: ours, llama.cpp's formats, and "
        "transformers' "
        "QuantizedCache with quanto and HQQ where installed); the names are listed below",
    )
    ppl.add_argument(
        "--protocols",
        default=None,
        help="one-forward (each window in one pass) and/or chunked (half the window prefilled, the rest fed "
        f"--chunk tokens at a time so scored tokens attend to stored history); default {QUICK.protocols[0]}, "
        f"--full: {','.join(PROTOCOLS)}",
    )
    ppl.add_argument("--chunk", type=_at_least(1), default=CHUNK, help="tokens per step of the chunked protocol")
    ppl.add_argument("--out", default="hf-deltakv-out", help="folder for ppl.json and the PNG plots")
    ppl.add_argument(
        "--overwrite",
        action="store_true",
        help="replace ppl.json and the plots in --out even where an earlier run did not write them",
    )
    ppl.add_argument("--no-plots", action="store_true", help="skip the PNG plots (they need matplotlib)")
    ppl.add_argument("--no-progress", action="store_true")
    _add_train_parser(sub)
    return parser


def _add_train_parser(sub) -> None:
    from .residual import ResidualLayout
    from .residual.train import TrainConfig

    defaults = TrainConfig()
    train = sub.add_parser("train-residual", help="train the learned residual cache's compressor for a model")
    train.add_argument("--model", default=None, help="hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    train.add_argument(
        "--text",
        default="stdlib-code",
        help="training text: a built-in source or a file path; "
        "several joined with '+' (never the test split you report on)",
    )
    train.add_argument("--out", default="residual-compressor", help="run folder (resumes when it holds a run)")
    # every numeric TrainConfig field is an option of the same name (bounds are checked by TrainConfig, before the
    # model is loaded)
    for field in dataclasses.fields(TrainConfig):
        kind = type(field.default)
        if kind in (int, float):
            train.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default)
    train.add_argument(
        "--loss",
        choices=("kl", "ce"),
        default=defaults.loss,
        help="next-token loss: KL from the "
        "uncompressed model (default) or cross-entropy on the text (DeltaKV's; adapts to the text)",
    )
    layout = ResidualLayout()
    train.add_argument(
        "--stride",
        type=int,
        default=layout.stride,
        help="every stride-th token is a reference (0: none, the default: on SmolLM2 references did not pay for "
        "their bytes)",
    )
    train.add_argument("--top-k", type=int, default=layout.top_k, help="nearest references averaged into a base")
    train.add_argument("--sink-tokens", type=int, default=layout.sink_tokens)
    train.add_argument("--window", type=int, default=layout.window, help="recent tokens kept raw")
    train.add_argument(
        "--reference-format", default=layout.reference_format, help="block format of references (f16 = raw)"
    )
    train.add_argument("--no-progress", action="store_true")


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


def default_caches(model: str | None = None, quick: bool = False) -> tuple[str, ...]:
    """Our default comparison (with the residual cache when its built-in compressor fits the model) plus, unless
    `quick`, transformers' QuantizedCache anchors whose backend is installed."""
    from .compare import FULL, QUICK
    from .models import DEFAULT_MODEL

    base = (QUICK if quick else FULL).caches
    ours = (*base, "residual") if model in (None, DEFAULT_MODEL) else base
    if quick:
        return ours
    anchors = []
    for name in ("hf-quanto", "hf-hqq"):
        if CACHES[name].available():
            anchors.append(name)
        else:
            print(
                f"note: {name} skipped ({CACHES[name].requires} not installed: pip install 'hf-deltakv[anchors]')",
                file=sys.stderr,
            )
    return (*ours, *anchors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = {"ppl": run_ppl, "train-residual": run_train_residual}[args.command]
    try:
        return run(args)
    except UsageError as err:
        print(f"hf-deltakv {args.command}: error: {err}", file=sys.stderr)
        return 2


def run_train_residual(args: argparse.Namespace) -> int:
    import torch

    from .eval.texts import load_text
    from .models import load_model
    from .residual import ResidualLayout
    from .residual.checkpoint import save_compressor
    from .residual.train import TrainConfig, train_residual

    try:
        config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
        layout = ResidualLayout(args.stride, args.top_k, args.sink_tokens, args.window, args.reference_format)
    except ValueError as err:
        raise UsageError(str(err)) from None
    _check_text(args.text)
    _check_out_folder(Path(args.out), (), overwrite=True)  # a run folder resumes: only writability matters
    model, tokenizer = load_model(args.model)
    text = "\n\n".join(load_text(part) for part in args.text.split("+"))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    try:
        compressor = train_residual(model, ids, args.out, config, layout, args.text, not args.no_progress)
    except ValueError as err:  # a text too short, a run folder of another model or layout
        raise UsageError(str(err)) from None
    final = save_compressor(compressor, Path(args.out) / "final", dtype=torch.float16)
    print(f"wrote {final} (load with ResidualKVCache.from_pretrained({str(final)!r}, model=model))", file=sys.stderr)
    return 0


PPL_FILES = ("ppl.json", "delta_vs_bits.png", "delta_vs_ctx.png")
# What a `ppl` run wrote into --out, file name -> sha256: a later run replaces those files (and removes those it does
# not write again, e.g. a plot against context length a one-length run skips), never a file it did not write.
PPL_RECORD = ".hf-deltakv-ppl.json"


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _earlier_output(out: Path) -> tuple[str, ...]:
    """The files of PPL_FILES an earlier `ppl` run wrote into `out` and nothing changed since (by PPL_RECORD)."""
    import json

    try:
        record = json.loads((out / PPL_RECORD).read_text())
    except (OSError, ValueError):
        return ()
    if not isinstance(record, dict):
        return ()
    own = []
    for name in PPL_FILES:
        path = out / name
        with contextlib.suppress(OSError):
            if path.is_file() and record.get(name) == _digest(path):
                own.append(name)
    return tuple(own)


def ppl_plan(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], int]:
    """(caches, protocols, ctx, windows) of a `ppl` command line: the quick preset, or `--full`, with any option
    given overriding it; mistakes are `UsageError`s, found before any model is loaded."""
    from .compare import FULL, QUICK
    from .eval.perplexity import PROTOCOLS
    from .registry import parse_spec

    preset = FULL if args.full else QUICK
    if args.caches is not None and not split_specs(args.caches):
        raise UsageError("--caches is empty; name at least one cache, e.g. --caches fp16,delta")
    caches = split_specs(args.caches) if args.caches else default_caches(args.model, quick=not args.full)
    try:
        for spec in caches:
            parse_spec(spec)
    except ValueError as err:
        raise UsageError(f"--caches: {err}") from None
    protocols = preset.protocols
    if args.protocols is not None:
        protocols = tuple(p.strip() for p in args.protocols.split(",") if p.strip())
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if not protocols or unknown:
        raise UsageError(f"--protocols must name some of {PROTOCOLS}, got {args.protocols!r}")
    ctx = preset.ctx if args.ctx is None else args.ctx
    windows = preset.windows if args.windows is None else args.windows
    if any(n < 2 for n in ctx):
        raise UsageError(f"--ctx lengths must be at least 2 tokens, got {','.join(map(str, ctx))}")
    return caches, protocols, ctx, windows


def run_ppl(args: argparse.Namespace) -> int:
    from .compare import compare_caches, estimated_seconds, markdown_table, write_json
    from .kernels import prebuilt_only
    from .models import load_model

    caches, protocols, ctx, windows = ppl_plan(args)
    _check_text(args.text)
    out = Path(args.out)
    earlier = _earlier_output(out) if out.is_dir() else ()
    _check_out_folder(out, PPL_FILES, args.overwrite, own=earlier)
    minutes = estimated_seconds(caches, protocols, ctx, windows) / 60
    kind = "full" if args.full else "quick (--full for both protocols and every cache)"
    print(f"hf-deltakv ppl: {kind} comparison of {len(caches)} caches, {', '.join(protocols)}, {windows} window(s) "
          f"of {','.join(map(str, ctx))} tokens: ~{max(minutes, 0.5):.1f} min on 2 CPU cores for SmolLM2-135M "
          "after the model loads", file=sys.stderr, flush=True)  # fmt: skip
    model, tokenizer = load_model(args.model)
    # One forward per window never decodes: the compiled kernels compute the same bytes, so a run of that protocol
    # alone does not wait for their build (a decoding run builds them, with a progress bar).
    scope = prebuilt_only() if protocols == ("one-forward",) else contextlib.nullcontext()
    try:
        with scope:
            result = compare_caches(
                model, tokenizer, args.text, caches, ctx, windows, not args.no_progress, protocols, args.chunk
            )
    except ValueError as err:  # a cache's parameters, a text too short for the windows
        raise UsageError(str(err)) from None
    print(markdown_table(result))
    write_json(result, out / "ppl.json")
    written = [out / "ppl.json"]
    if not args.no_plots:
        from .eval.plots import plot_delta_vs_bits, plot_delta_vs_ctx

        try:
            written.append(plot_delta_vs_bits(result, out / "delta_vs_bits.png"))
            by_ctx = plot_delta_vs_ctx(result, out / "delta_vs_ctx.png")
            if by_ctx is None:
                print(f"note: no delta_vs_ctx.png: the run measured one context length ({ctx[0]}); a plot against "
                      "length needs two or more (e.g. --ctx 512,1024,2048)", file=sys.stderr)  # fmt: skip
            else:
                written.append(by_ctx)
        except ImportError as err:
            print(f"note: {err}", file=sys.stderr)
    stale = [out / name for name in earlier if out / name not in written]
    for path in stale:  # an earlier run's file this run did not write again: it would not match ppl.json
        path.unlink(missing_ok=True)
    write_json({path.name: _digest(path) for path in written}, out / PPL_RECORD)
    replaced = [name for name in earlier if out / name in written]
    print("wrote " + ", ".join(str(p) for p in written)
          + (f" (replacing the previous run's {', '.join(replaced)})" if replaced else "")
          + (f"; removed the previous run's {', '.join(p.name for p in stale)}" if stale else ""),
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
