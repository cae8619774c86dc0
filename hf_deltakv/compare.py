"""Side-by-side perplexity of several caches on one model and text, as a table and JSON."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .eval.perplexity import CHUNK, PROTOCOLS, perplexity, token_windows
from .eval.texts import DEFAULT_TEXT, load_text
from .registry import build_cache

DEFAULT_CACHES = ("fp16", "q8_0", "q4_0", "q4_1", "q4_0-rot", "kivi", "kivi-pre-rope", "delta")
DEFAULT_CTX = (1024,)
DEFAULT_WINDOWS = 4


@dataclass(frozen=True)
class Preset:
    """What `hf-deltakv ppl` measures when not told otherwise: caches (`cli.default_caches` adds the residual cache
    for the default model, and transformers' own QuantizedCache where installed to the full comparison), protocols,
    context lengths and windows per length."""

    caches: tuple[str, ...]
    protocols: tuple[str, ...]
    ctx: tuple[int, ...]
    windows: int


# The first command a newcomer runs: one forward per window on two windows, our caches (with the learned residual
# cache where its built-in compressor fits the model: `cli.default_caches`) beside llama.cpp's q8_0 and q4_0 and the
# KIVI-style layout; ~1 min on 2 CPU cores.
QUICK = Preset(("fp16", "q8_0", "q4_0", "kivi-pre-rope", "delta"), ("one-forward",), DEFAULT_CTX, 2)
# `--full`: both protocols, every default cache (transformers' QuantizedCache needs the chunked one to show its loss).
FULL = Preset(DEFAULT_CACHES, PROTOCOLS, DEFAULT_CTX, DEFAULT_WINDOWS)
# Seconds per window of 1024 tokens on 2 CPU cores (SmolLM2-135M, measured by the CLI's runs here): the estimate
# printed before a comparison starts.
SECONDS_PER_WINDOW = {"one-forward": 5.0, "chunked": 18.0}


def estimated_seconds(caches: tuple[str, ...], protocols: tuple[str, ...], ctx: tuple[int, ...], windows: int) -> float:
    """A rough duration of `compare_caches` on 2 CPU cores for the default model (time grows with the window's
    length; larger models take longer)."""
    per_cache = sum(SECONDS_PER_WINDOW[p] * n / 1024 * windows for p in protocols for n in ctx)
    return per_cache * len(caches)


def compare_caches(
    model,
    tokenizer,
    text: str = DEFAULT_TEXT,
    caches: tuple[str, ...] = DEFAULT_CACHES,
    ctx: tuple[int, ...] = DEFAULT_CTX,
    windows: int = DEFAULT_WINDOWS,
    progress: bool = True,
    protocols: tuple[str, ...] = PROTOCOLS,
    chunk: int = CHUNK,
) -> dict:
    """Perplexity of every cache spec at every context length under every protocol; Δ is relative to the first cache.

    Protocols (see `perplexity`): `one-forward` scores each window in one pass; `chunked` prefills half the window
    and feeds the rest `chunk` tokens at a time, so that scored tokens attend to the stored history.

    Returns:
        a JSON-ready dict: `config` (everything needed to rerun) and `rows`.
    """
    for spec in caches:
        build_cache(spec, model)  # fail on a bad spec before spending any time
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; allowed: {PROTOCOLS}")
    ids = tokenizer(load_text(text), return_tensors="pt").input_ids[0]
    rows = []
    bar = _progress_bar(len(protocols) * len(caches) * len(ctx) * windows, progress)
    for protocol in protocols:
        for n in ctx:
            wins = token_windows(ids, n, windows)
            reference = None
            for spec in caches:
                result = perplexity(
                    model,
                    wins,
                    lambda spec=spec: build_cache(spec, model),
                    lambda i: bar.update(1),
                    reference=None if reference is None else reference.logprobs,
                    keep_logprobs=reference is None,
                    protocol=protocol,
                    chunk=chunk,
                )
                reference = reference or result
                row = asdict(result)
                row.pop("logprobs")
                delta = 100 * (result.perplexity / reference.perplexity - 1)
                rows.append({"cache": spec, "ctx": n, "delta_pct": delta, **row})
    bar.close()
    config = {
        "model": Path(getattr(model, "name_or_path", "") or type(model).__name__).name,
        "model_dtype": str(next(model.parameters()).dtype),
        "text": text,
        "tokens_in_text": int(ids.numel()),
        "caches": list(caches),
        "ctx": list(ctx),
        "windows": windows,
        "reference": caches[0],
        "protocols": list(protocols),
        "chunk": chunk,
        "protocol": "one-forward: one pass per window through a fresh cache, every prediction scored; chunked: the "
        f"first half of the window prefilled, the second half fed {chunk} tokens at a time (teacher-forced) and "
        "scored, bits/element averaged over the chunk steps; KL divergence and top-1 agreement against the first "
        "cache's next-token distributions under the same protocol",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    return {"config": config, "rows": rows}


def markdown_table(result: dict) -> str:
    """The rows as a Markdown table (KL divergence and top-1 agreement against the reference cache)."""
    ref = result["config"]["reference"]
    lines = [
        f"| cache | protocol | ctx | perplexity | Δ vs {ref} | KL div. vs {ref} | top-1 agree | bits/element "
        "| seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        kl = "—" if row["kl_divergence"] is None else f"{row['kl_divergence']:.5f}"
        top1 = "—" if row["top1_agreement"] is None else f"{100 * row['top1_agreement']:.2f} %"
        lines.append(
            f"| {row['cache']} | {row.get('protocol', 'one-forward')} | {row['ctx']} | {row['perplexity']:.4f} "
            f"| {row['delta_pct']:+.2f} % | {kl} | {top1} | {row['bits_per_element']:.3f} | {row['seconds']:.1f} |"
        )
    return "\n".join(lines)


def write_json(result: dict, path: str | Path) -> None:
    """Write `result` as JSON atomically (a temporary file renamed over `path`): never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


class _NoBar:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="windows", unit="win")
