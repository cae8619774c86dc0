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
    """Quality lost against measured bits/element at the longest context, one point per cache and protocol: KL
    divergence from the reference on a log axis (left; caches a few 1e-3 apart stay apart beside q4_0's tenfold
    loss) and perplexity Δ on a symmetric-log axis (right; linear within ±0.1 %, where a gain is noise)."""
    plt = _pyplot()
    ctx = max(result["config"]["ctx"])
    ref = result["config"]["reference"]
    rows = [row for row in result["rows"] if row["ctx"] == ctx and row["cache"] != ref]
    colors = {cache: f"C{i % 10}" for i, cache in enumerate(dict.fromkeys(row["cache"] for row in rows))}
    fig, (kl_ax, ppl_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for row in rows:
        protocol = row.get("protocol", "one-forward")
        style = dict(marker=_MARKERS.get(protocol, "^"), color=colors[row["cache"]])
        label = f"{row['cache']} ({protocol})"
        if row["kl_divergence"] is not None and row["kl_divergence"] > 0:  # 0 (an identical cache) has no log
            kl_ax.scatter(row["bits_per_element"], row["kl_divergence"], **style)
        ppl_ax.scatter(row["bits_per_element"], row["delta_pct"], label=label, **style)
    kl_ax.set_yscale("log")
    kl_ax.set_ylabel(f"KL divergence from {ref} (nats/token, log)")
    ppl_ax.set_yscale("symlog", linthresh=0.1)
    ppl_ax.axhline(0, color="grey", linewidth=0.5)
    ppl_ax.set_ylabel(f"perplexity Δ vs {ref} (%, symmetric log)")
    for ax in (kl_ax, ppl_ax):
        ax.set_xlabel("measured bits per cached element")
        ax.grid(True, which="major", linewidth=0.3)
    ppl_ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"{result['config']['model']}, {Path(str(result['config']['text'])).name}, ctx {ctx}")
    return _save(fig, path)


def plot_delta_vs_ctx(result: dict, path: str | Path) -> Path | None:
    """KL divergence from the reference (log axis) against context length, one line per cache and protocol; None
    (and no file) when the run measured fewer than two lengths: a line needs two points."""
    if len(set(result["config"]["ctx"])) < 2:
        return None
    plt = _pyplot()
    ref = result["config"]["reference"]
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in result["rows"]:
        if row["cache"] != ref and row["kl_divergence"] is not None and row["kl_divergence"] > 0:
            lines.setdefault((row["cache"], row.get("protocol", "one-forward")), []).append(
                (row["ctx"], row["kl_divergence"])
            )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (cache, protocol), points in lines.items():
        points.sort()
        ax.plot(*zip(*points, strict=True), marker=_MARKERS.get(protocol, "^"), label=f"{cache} ({protocol})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"KL divergence from {ref} (nats/token, log)")
    ax.grid(True, which="major", linewidth=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
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
