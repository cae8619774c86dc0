"""Memory/quality trade-off of the residual cache: latent rate, reference stride and top-k, on SmolLM2-135M.

Each point is a compressor fitted (PCA + sensitivity-weighted bit allocation, no gradient training) on 8 windows of
WikiText-2 valid, then measured on 4 windows of 1024 tokens of WikiText-2 test, one forward each. Bits per element
are measured (references, their ids, sinks, window, codes and scales all counted).

    python benchmarks/residual_tradeoff.py          # ~20 min on 2 CPU cores

Writes benchmarks/results/residual_tradeoff.json and residual_tradeoff.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from paths import RESULTS, WIKITEXT_TEST, WIKITEXT_VALID

from hf_deltakv import DeltaKVCache, ResidualKVCache
from hf_deltakv.eval.perplexity import perplexity, token_windows
from hf_deltakv.models import load_model
from hf_deltakv.residual import ResidualLayout
from hf_deltakv.residual.fit import fit_compressor

# (latent rate, stride, top_k, sensitivity windows): the rate sweep without references; references at the default
# rate; the default with bits spread evenly over layers instead of by measured sensitivity
POINTS = [
    (3.3, 0, 1, 2),
    (3.8, 0, 1, 2),
    (4.3, 0, 1, 2),
    (4.3, 16, 1, 2),
    (4.3, 16, 4, 2),
    (4.3, 0, 1, 0),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=16, help="raw recent tokens")
    parser.add_argument("--out", default=str(RESULTS / "residual_tradeoff.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    valid = tokenizer(Path(WIKITEXT_VALID).read_text(), return_tensors="pt").input_ids[0]
    test = tokenizer(Path(WIKITEXT_TEST).read_text(), return_tensors="pt").input_ids[0]
    calibration = [w.unsqueeze(0) for w in token_windows(valid, args.ctx, 8)]
    windows = token_windows(test, args.ctx, args.windows)
    reference = perplexity(model, windows, keep_logprobs=True)
    rows = []

    def record(name: str, result, **extra) -> None:
        delta = 100 * (result.perplexity / reference.perplexity - 1)
        rows.append(
            {
                "name": name,
                "perplexity": result.perplexity,
                "delta_pct": delta,
                "kl": result.kl_divergence,
                "bits": result.bits_per_element,
                **extra,
            }
        )
        print(
            f"{name:<34} ppl {result.perplexity:8.3f} ({delta:+.2f} %)  KL {result.kl_divergence:.4f}  "
            f"{result.bits_per_element:.2f} bits",
            flush=True,
        )

    record(
        "delta (DeltaKVCache defaults)",
        perplexity(model, windows, lambda: DeltaKVCache(model=model), reference=reference.logprobs),
    )
    for rate, stride, top_k, sensitivity in POINTS:
        began = time.perf_counter()
        layout = ResidualLayout(stride=stride, top_k=top_k, sink_tokens=8, window=args.window, reference_format="q8_0")
        compressor = fit_compressor(model, calibration, rate, layout, sensitivity_windows=sensitivity)
        result = perplexity(
            model, windows, lambda c=compressor: ResidualKVCache(model, c), reference=reference.logprobs
        )
        record(
            f"residual rate={rate} stride={stride} k={top_k}" + ("" if sensitivity else ", even bits"),
            result,
            rate=rate,
            stride=stride,
            top_k=top_k,
            sensitivity_windows=sensitivity,
            seconds=round(time.perf_counter() - began, 1),
        )
    payload = {
        "config": {
            "model": "SmolLM2-135M-Instruct",
            "ctx": args.ctx,
            "windows": args.windows,
            "window": args.window,
            "calibration": "WikiText-2 valid, 8 windows",
            "text": "WikiText-2 test",
            "protocol": "one-forward",
            "reference_perplexity": reference.perplexity,
        },
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    plot(payload, out.with_suffix(".png"))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sweep = [r for r in payload["rows"] if r.get("stride") == 0 and r.get("sensitivity_windows")]
    ax.plot([r["bits"] for r in sweep], [r["kl"] for r in sweep], "o-", label="residual, no references (rate sweep)")
    for r in payload["rows"]:
        if r.get("stride"):
            ax.plot(r["bits"], r["kl"], "s", label=f"residual, stride {r['stride']}, k={r['top_k']}")
        elif r.get("sensitivity_windows") == 0:
            ax.plot(r["bits"], r["kl"], "D", label="residual, bits spread evenly over layers")
        elif "stride" not in r:
            ax.plot(r["bits"], r["kl"], "^", color="black", label=r["name"])
    ax.set_xlabel("measured bits per element")
    ax.set_ylabel("KL divergence from the uncompressed model")
    ax.set_title(f"SmolLM2-135M, WikiText-2 test, {payload['config']['windows']}×{payload['config']['ctx']} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
