"""Weight skip: decode speed and quality against the plain model, for a sweep of calibrated sparsities.

For each model and dtype, the rows are: exact mode (`threshold=0`), calibrated `sparsity=s` for each `--sparsities`,
and the seed's bound rule (`threshold=--bound`, blocks of 32). Per row:
- decode tokens/s after a `--prompt`-token prompt, greedy, DynamicCache; every configuration (the plain model
  included) runs once per round, `--rounds` rounds in a rotating order, and the median is reported, so drift on a
  noisy machine hits all alike; the ratio is against the plain model's median in the same run;
- perplexity, KL divergence and top-1 agreement against the plain model on WikiText-2 test: `PROMPT` tokens of each
  window prefilled (a prompt: prefills are not skipped), then the rest fed one token at a time and scored (weight
  skip acts on decode-shaped inputs only: a one-forward perplexity would not see it);
- the fraction of the selected weights left unread, as counted by the hook;
- for the calibrated rows, the same measures on `--sim-windows` windows (64 by default: 4 windows move perplexity by
  several percent), each in one forward with `SkipSimulator` applying the rule to every token (tests hold decoding
  token by token to it), scored after the same `PROMPT` tokens (which skip too here, where a prefill would not).

Writes benchmarks/results/weight_skip.json and weight_skip.png (the speed/quality curve per model and dtype).

    python benchmarks/weight_skip.py                         # both models, fp32 and bf16: ~40 min on 2 CPU cores
    python benchmarks/weight_skip.py --models smollm2-135m --dtypes float32 --windows 0   # speed only, ~3 min
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from paths import RESULTS, WIKITEXT_TEST, machine

from hf_deltakv.eval.perplexity import perplexity, token_windows
from hf_deltakv.eval.texts import load_text
from hf_deltakv.models import load_model
from hf_deltakv.weight_skip import SkipSimulator, enable_weight_skip

SPARSITIES = (0.1, 0.2, 0.25, 0.4, 0.5)
BOUND = 0.01  # the bound rule's relative budget for its row
PROMPT = 32  # tokens of each perplexity window prefilled first (as a prompt is), unscored
TOKEN_BY_TOKEN = {"protocol": "chunked", "prefix": PROMPT, "chunk": 1}


@torch.no_grad()
def decode_rate(model, ids: torch.Tensor, new: int) -> float:
    """Greedy decode tokens/s after prefilling `ids` (the prefill is not timed)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    start = time.perf_counter()
    for _ in range(new):
        logits = model(logits[:, -1].argmax(-1, keepdim=True), cache=cache, use_cache=True).logits
    return new / (time.perf_counter() - start)


@torch.no_grad()
def simulated_quality(model, windows: list[torch.Tensor], sparsities: list[float]) -> dict[float, dict]:
    """Per sparsity: perplexity Δ, KL divergence and top-1 agreement against the plain model over `windows`, one
    forward each with `SkipSimulator`, scored after `PROMPT` tokens (the plain run is redone per window rather than
    kept: a window's log-probabilities over Gemma's vocabulary are 0.3 GB)."""
    simulator = SkipSimulator(model)
    sums = {s: {"nll": 0.0, "kl": 0.0, "agree": 0.0} for s in sparsities}
    plain_nll, count = 0.0, 0
    device = next(model.parameters()).device

    def scored(ids: torch.Tensor) -> torch.Tensor:
        return model(ids).logits[0, PROMPT - 1 : -1].float().log_softmax(-1)

    for window in windows:
        ids = window[None].to(device)
        targets = ids[0, PROMPT:, None]
        plain = scored(ids)
        plain_nll -= float(plain.gather(1, targets).sum())
        for sparsity in sparsities:
            with simulator.skipping(sparsity):
                skipping = scored(ids)
            sums[sparsity]["nll"] -= float(skipping.gather(1, targets).sum())
            sums[sparsity]["kl"] += float((plain.exp() * (plain - skipping)).sum())
            sums[sparsity]["agree"] += float((plain.argmax(-1) == skipping.argmax(-1)).sum())
        count += len(targets)
    base = plain_nll / count
    return {
        s: {
            "sim_delta_pct": 100 * (math.exp(sums[s]["nll"] / count - base) - 1),
            "sim_kl_divergence": sums[s]["kl"] / count,
            "sim_top1_agreement": sums[s]["agree"] / count,
        }
        for s in sparsities
    }


def configurations(sparsities: list[float], bound: float) -> list[tuple[str, dict | None]]:
    rows = [("plain", None), ("exact (threshold=0)", {"threshold": 0.0})]
    rows += [(f"sparsity={s}", {"sparsity": s}) for s in sparsities]
    rows.append((f"bound rule (threshold={bound})", {"threshold": bound}))
    return rows


def measure(model, tokenizer, args, dtype_name: str, model_name: str) -> list[dict]:
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[0]
    prompt = ids[None, -args.prompt :]
    started = time.perf_counter()
    enable_weight_skip(model, sparsity=0.1).remove()  # calibrates (or loads the cached calibration)
    calibration_s = time.perf_counter() - started
    configs = configurations([float(s) for s in args.sparsities.split(",")], args.bound)
    rates: dict[str, list[float]] = {name: [] for name, _ in configs}
    decode_rate(model, prompt, 2)  # warm-up: kernels built, caches touched
    for round_ in range(args.rounds):
        for name, options in configs[round_ % len(configs) :] + configs[: round_ % len(configs)]:
            if options is None:
                rates[name].append(decode_rate(model, prompt, args.new))
            else:
                with enable_weight_skip(model, **options):
                    rates[name].append(decode_rate(model, prompt, args.new))
    plain_rate = statistics.median(rates["plain"])
    windows = token_windows(ids, args.ctx, args.windows) if args.windows else None
    reference = perplexity(model, windows, keep_logprobs=True, **TOKEN_BY_TOKEN) if windows is not None else None
    calibrated = [options["sparsity"] for _, options in configs if options and "sparsity" in options]
    simulated = (
        simulated_quality(model, token_windows(ids, args.ctx, args.sim_windows), calibrated) if args.sim_windows else {}
    )
    rows = []
    for name, options in configs:
        row = {
            "model": model_name,
            "dtype": dtype_name,
            "config": name,
            "options": options,
            "tokens_per_s": statistics.median(rates[name]),
            "speed_ratio": statistics.median(rates[name]) / plain_rate,
            "rates": rates[name],
            "calibration_s": calibration_s,
        }
        if options is None:
            row.update(skipped_fraction=0.0)
            if reference is not None:
                row.update(perplexity=reference.perplexity, delta_pct=0.0, kl_divergence=0.0, top1_agreement=1.0)
        else:
            with enable_weight_skip(model, **options) as handle:
                decode_rate(model, prompt, 4)  # counted by the hook even without quality windows
                if reference is not None:
                    quality = perplexity(model, windows, reference=reference.logprobs, **TOKEN_BY_TOKEN)
                    row.update(
                        perplexity=quality.perplexity,
                        delta_pct=100 * (quality.perplexity / reference.perplexity - 1),
                        kl_divergence=quality.kl_divergence,
                        top1_agreement=quality.top1_agreement,
                    )
            row["skipped_fraction"] = handle.stats()["total"]["skipped_fraction"]
            if "sparsity" in options:  # where the allocation put it: per projection kind, the fraction skipped
                row["kind_levels"] = handle.calibration.kind_levels(options["sparsity"])
                row.update(simulated.get(options["sparsity"], {}))
        rows.append(row)
        print(f"  {model_name} {dtype_name} {name}: {row['speed_ratio']:.2f}x", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sparsities", default=",".join(str(s) for s in SPARSITIES))
    parser.add_argument("--bound", type=float, default=BOUND, help="the bound rule's threshold for its row")
    parser.add_argument("--text", default=str(WIKITEXT_TEST))
    parser.add_argument("--ctx", type=int, default=288, help="tokens per perplexity window (PROMPT of them prefilled)")
    parser.add_argument("--windows", type=int, default=4, help="perplexity windows (0: speed only)")
    parser.add_argument("--sim-windows", type=int, default=64, help="windows of the simulated quality (0: none)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens before timed decoding")
    parser.add_argument("--new", type=int, default=24, help="tokens decoded per timing run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "weight_skip.json"))
    args = parser.parse_args(argv)

    rows = []
    for model_name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            model, tokenizer = load_model(model_name, dtype=getattr(torch, dtype_name))
            rows += measure(model, tokenizer, args, dtype_name, model_name)
            del model
    print(markdown(rows))
    print("\n" + allocation(rows))
    config = {
        **vars(args),
        "text": Path(args.text).name,
        "threads": torch.get_num_threads(),
        "perplexity_prompt": PROMPT,
        "date": time.strftime("%F"),
        "machine": machine(),
    }
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    plot(rows, Path(args.out).with_suffix(".png"))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | dtype | configuration | weights not read | decode tok/s | vs plain | perplexity Δ | KL div. "
        "| top-1 | perplexity Δ, KL (simulated, many windows) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        quality = (
            f"{r['delta_pct']:+.2f} % | {r['kl_divergence']:.4f} | {100 * r['top1_agreement']:.1f} %"
            if "delta_pct" in r
            else "– | – | –"
        )
        simulated = f"{r['sim_delta_pct']:+.2f} %, {r['sim_kl_divergence']:.4f}" if "sim_delta_pct" in r else "–"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['config']} | {100 * r['skipped_fraction']:.1f} % "
            f"| {r['tokens_per_s']:.1f} | {r['speed_ratio']:.2f}x | {quality} | {simulated} |"
        )
    return "\n".join(lines)


def allocation(rows: list[dict]) -> str:
    """Where the greedy allocation put each sparsity: per projection kind, the fraction of its input channels skipped
    (calibration text); the kinds named by their last part (`q_proj,k_proj,v_proj`, `down_proj`, `lm_head`)."""
    rows = [r for r in rows if "kind_levels" in r and r["dtype"] == rows[0]["dtype"]]
    kinds = list(dict.fromkeys(kind for r in rows for kind in r["kind_levels"]))
    short = [",".join(part.split(".")[-1] for part in kind.split(",")) for kind in kinds]
    lines = ["| model | configuration | " + " | ".join(short) + " |", "|---|---|" + "---:|" * len(kinds)]
    for r in rows:
        cells = [f"{r['kind_levels'][k]:.2f}" if k in r["kind_levels"] else "–" for k in kinds]
        lines.append(f"| {r['model']} | {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    series = sorted({(r["model"], r["dtype"]) for r in rows})
    for model_name, dtype_name in series:
        picked = [r for r in rows if (r["model"], r["dtype"]) == (model_name, dtype_name) and "sparsity" in r["config"]]
        plain = [r for r in rows if (r["model"], r["dtype"]) == (model_name, dtype_name) and r["options"] is None]
        picked = plain + picked
        x = [100 * r["skipped_fraction"] for r in picked]
        label = f"{model_name} {dtype_name}"
        left.plot(x, [r["speed_ratio"] for r in picked], marker="o", label=label)
        simulated = [r for r in picked if "sim_delta_pct" in r]
        if simulated:
            right.plot(
                [100 * r["skipped_fraction"] for r in simulated],
                [r["sim_delta_pct"] for r in simulated],
                marker="o",
                label=label,
            )
    left.axhline(1.0, color="grey", linewidth=0.5)
    left.set_xlabel("weights not read (%)")
    left.set_ylabel("decode tokens/s vs plain")
    left.legend(fontsize=7)
    right.set_xlabel("weights not read (%)")
    right.set_ylabel("perplexity Δ (%), simulated, many windows")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
