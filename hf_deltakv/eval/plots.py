"""PNG plots of a comparison (`compare_caches` result): quality lost against bits spent, and against context length.

matplotlib is an optional extra (`pip install 'hf-deltakv[plots]'`); it is imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path

_MARKERS = {"one-forward": "o", "chunked": "s"}


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'hf-deltakv[plots]'") from err
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_delta_vs_bits(result: dict, path: str | Path) -> Path:
    """Δ perplexity vs measured bits/element, one point per cache and protocol, at the longest context."""
    plt = _pyplot()
    ctx = max(result["config"]["ctx"])
    ref = result["config"]["reference"]
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    caches = list(dict.fromkeys(row["cache"] for row in result["rows"] if row["cache"] != ref))
    colors = {cache: f"C{i % 10}" for i, cache in enumerate(caches)}
    for row in result["rows"]:
        if row["ctx"] != ctx or row["cache"] == ref:
            continue
        protocol = row.get("protocol", "one-forward")
        ax.scatter(
            row["bits_per_element"],
            row["delta_pct"],
            marker=_MARKERS.get(protocol, "^"),
            color=colors[row["cache"]],
            label=f"{row['cache']} ({protocol})",
        )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("measured bits per cached element")
    ax.set_ylabel(f"perplexity Δ vs {ref} (%)")
    ax.set_title(f"{result['config']['model']}, {Path(str(result['config']['text'])).name}, ctx {ctx}")
    return _save(fig, path)


def plot_delta_vs_ctx(result: dict, path: str | Path) -> Path:
    """Δ perplexity vs context length, one line per cache and protocol."""
    plt = _pyplot()
    ref = result["config"]["reference"]
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in result["rows"]:
        if row["cache"] != ref:
            lines.setdefault((row["cache"], row.get("protocol", "one-forward")), []).append(
                (row["ctx"], row["delta_pct"])
            )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (cache, protocol), points in lines.items():
        points.sort()
        ax.plot(*zip(*points, strict=True), marker=_MARKERS.get(protocol, "^"), label=f"{cache} ({protocol})")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"perplexity Δ vs {ref} (%)")
    ax.legend(fontsize=7)
    ax.set_title(f"{result['config']['model']}, {Path(str(result['config']['text'])).name}")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    """Save atomically (a temporary file renamed over `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120)
    _pyplot().close(fig)
    os.replace(tmp, path)
    return path
