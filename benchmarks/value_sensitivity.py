"""Where values below four bits lose (issue 44, step 1): KL divergence from the unmodified model when only values are
coded, per layer, per kv head, by the attention a token draws, and by the quantizer's levels.

Values are coded the way DeltaKVCache codes them (rotated by the block Hadamard, block-quantized with a searched
scale, the first `SINKS` tokens raw; keys untouched) inside the attention of one forward over each window: what a
cache hands attention in the one-forward protocol (an attention function registered through `AttentionInterface`
codes them before SDPA; nothing is stored: this measures where error turns into KL, not a cache). WikiText-2
validation split (tuning never reads test), windows of `--ctx` tokens, KL per predicted token, averaged.

- all layers: q3_0, q4_0 and q8_0 values (3.5, 4.5, 8.5 bits a value): the scale of the effect;
- per layer: only that layer's values at q3_0; their sum against all layers at once says whether KL adds up;
- per kv head: only that head of that layer at q3_0;
- tokens by the attention they draw: all layers at q3_0 but the tokens that draw the most (the softmax mass a token
  receives, summed over queries and the kv head's query heads) kept at q8_0, chosen (a) with every query seen (an
  oracle) and (b) causally, from the queries of the `WINDOW` tokens after it (what a cache can know when it codes a
  group), at 2, 5 and 10 % of the tokens;
- layers and kv heads by sensitivity: the most sensitive (per-layer or per-head KL above) at q4_0, the rest at q3_0;
- levels: 8 levels a block in place of q3_0's uniform ones, at the same bits (3-bit codes, one fp16 scale per 32):
  Lloyd-Max levels for a unit Gaussian times the block's RMS (or the multiple of it of least error, as q3_0's scale
  is searched), and levels fitted (Lloyd's algorithm) to the rotated, RMS-normalised values of the first window.

    python benchmarks/value_sensitivity.py                                  # SmolLM2 and Gemma 3, 2 × 1024: ~20 min
    python benchmarks/value_sensitivity.py --models smollm2-135m --windows 1 --ctx 512
Written to benchmarks/results/value_sensitivity.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from paths import RESULTS, WIKITEXT_VALID

from hf_deltakv.kernels.hadamard import rotate
from hf_deltakv.quant import SEARCHABLE_KINDS, dequantize, get_format, quantize

SINKS = 4  # raw tokens at the start, as DeltaKVCache keeps them
WINDOW = 32  # the causal choice sees the queries of this many tokens after a token (a group coded when it is full)
SHARES = (0.02, 0.05, 0.10)
PROBE = "hf_deltakv_value_probe"
# Lloyd-Max reconstruction levels of a unit Gaussian at 8 levels (Max 1960, Table I), the positive half
GAUSSIAN_8 = (0.2451, 0.7560, 1.3440, 2.1520)
BLOCK = 32  # values a scale covers (q3_0's block)


class Probe:
    """What the registered attention function does to each layer's values, and what it records."""

    def __init__(self) -> None:
        self.code = None  # (layer, values [B, H, T, D]) -> values
        self.record_mass = False
        self.mass: dict[int, torch.Tensor] = {}  # layer -> [B, H, T] softmax mass each key receives
        self.window_mass: dict[int, torch.Tensor] = {}  # the same from the WINDOW queries after each key

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        if self.record_mass:
            self._record(layer, module, query, key, attention_mask, kwargs)
        if self.code is not None:
            value = self.code(layer, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def _record(self, layer, module, query, key, attention_mask, kwargs) -> None:
        q_heads, tokens = query.shape[1], query.shape[2]
        kv_heads = key.shape[1]
        keys = key.repeat_interleave(q_heads // kv_heads, dim=1)
        scale = kwargs.get("scaling") or module.scaling
        scores = (query.float() @ keys.float().transpose(-1, -2)) * scale
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=query.device).tril()
        if isinstance(attention_mask, torch.Tensor):  # (sliding windows, padding)
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            causal = causal & allowed[..., :tokens, :tokens]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, Hq, queries, keys]
        grouped = weights.unflatten(1, (kv_heads, q_heads // kv_heads)).sum(2)  # [B, H, queries, keys]
        self.mass[layer] = grouped.sum(2)
        q = torch.arange(tokens, device=query.device)
        near = (q[:, None] >= q[None, :]) & (q[:, None] < q[None, :] + WINDOW)  # query within WINDOW after the key
        self.window_mass[layer] = (grouped * near).sum(2)


def _normalised(r: torch.Tensor) -> torch.Tensor:
    """Rotated values `[..., D]` over their block's RMS, flattened."""
    blocks = r.reshape(-1, BLOCK)
    rms = blocks.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    return (blocks / rms).flatten()


SCALE_SEARCH = torch.arange(0.70, 1.31, 0.05)  # multiples of the block's RMS tried as its scale (searched levels)


def block_levels(r: torch.Tensor, levels: torch.Tensor, search: bool = False) -> torch.Tensor:
    """Rotated values `[..., D]` coded with 8 `levels` (ascending, for unit RMS) times each block's scale (fp16: its
    RMS, or with `search` the multiple of it in `SCALE_SEARCH` of least squared error): the nearest level, decoded."""
    shape = r.shape
    blocks = r.reshape(-1, BLOCK)
    rms = blocks.pow(2).mean(-1, keepdim=True).sqrt()
    best, best_error = None, None
    for multiple in SCALE_SEARCH if search else (1.0,):
        scale = (rms * multiple).half().float()
        code = (blocks[..., None] / scale.clamp_min(1e-12)[..., None] - levels).abs().argmin(-1)
        decoded = levels[code] * scale
        error = (decoded - blocks).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, best_error = decoded, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, decoded, best), torch.minimum(error, best_error)
    return best.reshape(shape)


def block_coded(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` (fp32) coded in `fmt` and decoded, the scale searched where the cache searches it."""
    return dequantize(quantize(x, fmt, get_format(fmt).kind in SEARCHABLE_KINDS))


def rotated_blocks(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` (fp32, the last dimension a head's) rotated, coded in `fmt` as the cache codes it and rotated back."""
    return rotate(block_coded(rotate(x), fmt))


def coded(values: torch.Tensor, fmt: str, heads: list[int] | None = None, keep: torch.Tensor | None = None,
          keep_fmt: str = "q8_0", levels: torch.Tensor | None = None, search: bool = False,
          ) -> torch.Tensor:  # fmt: skip
    """`values` `[B, H, T, D]` as the cache hands them back: tokens after `SINKS` rotated, coded in `fmt` (or with
    `levels`, their scale searched with `search`), rotated back; only `heads` (None: all); tokens where `keep`
    `[B, H, T]` is set in `keep_fmt`."""
    x = values.float()
    body = rotate(x[:, :, SINKS:])
    if levels is not None:
        low = block_levels(body, levels, search)
    else:
        low = block_coded(body, fmt)
    if keep is not None:
        high = block_coded(body, keep_fmt)
        low = torch.where(keep[:, :, SINKS:, None], high, low)
    out = x.clone()
    chosen = slice(None) if heads is None else heads
    out[:, chosen, SINKS:] = rotate(low)[:, chosen]
    return out.to(values.dtype)


def _mixed_heads(values: torch.Tensor, high: list[int]) -> torch.Tensor:
    """`values` coded at q3_0, the kv heads `high` at q4_0."""
    out = coded(values, "q3_0")
    if high:
        out[:, high] = coded(values, "q4_0")[:, high]
    return out


def gaussian_levels() -> torch.Tensor:
    """The 8 Lloyd-Max levels of a unit Gaussian, ascending."""
    return torch.tensor([-v for v in reversed(GAUSSIAN_8)] + list(GAUSSIAN_8))


def fitted_levels(samples: torch.Tensor, iterations: int = 50) -> torch.Tensor:
    """8 levels for unit-RMS blocks fitted to `samples` by Lloyd's algorithm, from the Gaussian's."""
    levels = gaussian_levels()
    for _ in range(iterations):
        edges = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize(samples, edges)
        sums = torch.zeros(8).index_add_(0, cell, samples)
        counts = torch.zeros(8).index_add_(0, cell, torch.ones_like(samples))
        levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
    return levels


@torch.no_grad()
def measure(name: str, ctx: int, windows: int, head_layers: int | None) -> dict:
    from transformers import AttentionInterface

    from hf_deltakv.eval.perplexity import token_windows
    from hf_deltakv.models import load_model

    model, tokenizer = load_model(name)
    probe = Probe()
    AttentionInterface.register(PROBE, probe)
    model.set_attn_implementation(PROBE)
    text = WIKITEXT_VALID.read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    wins = [w[None] for w in token_windows(ids, ctx, windows)]
    config = model.config.get_text_config(decoder=True)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads

    probe.record_mass = True
    reference, masses, window_masses = [], [], []
    for w in wins:
        reference.append(model(w).logits[0, :-1].float().log_softmax(-1))
        masses.append(dict(probe.mass))
        window_masses.append(dict(probe.window_mass))
    probe.record_mass = False

    samples = []  # rotated, RMS-normalised values of the first window, every layer (for the fitted levels)

    def collect(layer, values):
        samples.append(_normalised(rotate(values[:, :, SINKS:].float())))
        return values

    probe.code = collect
    model(wins[0])
    sample = torch.cat(samples)
    sample = sample[torch.randperm(sample.numel(), generator=torch.Generator().manual_seed(0))[:2_000_000]]
    fitted = fitted_levels(sample)
    gaussian = gaussian_levels()

    def kl(code) -> float:
        """Mean KL per predicted token with `code(layer, values, window index)` applied."""
        total = count = 0.0
        for i, w in enumerate(wins):
            probe.code = lambda layer, values, i=i: code(layer, values, i)
            logprobs = model(w).logits[0, :-1].float().log_softmax(-1)
            ref = reference[i]
            total += (ref.exp() * (ref - logprobs)).sum().item()
            count += logprobs.shape[0]
        probe.code = None
        return total / count

    started = time.perf_counter()
    result = {"model": name, "ctx": ctx, "windows": windows, "layers": layers, "kv_heads": kv_heads,
              "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
              "all_layers": {}, "per_layer": [], "per_head": [], "tokens": [], "sensitive_layers": [],
              "sensitive_heads": [],
              "levels": {}}  # fmt: skip
    for fmt in ("q3_0", "q4_0", "q8_0"):
        result["all_layers"][fmt] = kl(lambda layer, v, i, fmt=fmt: coded(v, fmt))
        print(f"{name}: all layers {fmt}: KL {result['all_layers'][fmt]:.5f}", file=sys.stderr, flush=True)
    for layer in range(layers):
        value = kl(lambda at, v, i, layer=layer: coded(v, "q3_0") if at == layer else v)
        result["per_layer"].append(value)
        print(f"{name}: layer {layer} alone q3_0: KL {value:.5f}", file=sys.stderr, flush=True)
    ranked = sorted(range(layers), key=lambda layer: -result["per_layer"][layer])
    for layer in ranked[: head_layers or layers]:
        row = [result["per_layer"][layer]] if kv_heads == 1 else []  # (one kv head: the layer's, measured above)
        for head in range(len(row), kv_heads):
            row.append(kl(lambda at, v, i, layer=layer, head=head: coded(v, "q3_0", [head]) if at == layer else v))
        result["per_head"].append({"layer": layer, "kl": row})
        print(f"{name}: layer {layer} by head: {[round(x, 5) for x in row]}", file=sys.stderr, flush=True)
    for share in SHARES:
        for choice, source in (("oracle", masses), ("causal", window_masses)):

            def keep_top(layer, v, i, share=share, source=source):
                mass = source[i][layer].clone()
                mass[:, :, :SINKS] = -1.0  # (raw already)
                count = max(1, round(share * (mass.shape[-1] - SINKS)))
                top = mass.topk(count, dim=-1).indices
                keep = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, top, True)
                return coded(v, "q3_0", keep=keep)

            value = kl(keep_top)
            result["tokens"].append({"share": share, "choice": choice, "kl": value, "bits": 3.5 + share * 5.0})
            print(f"{name}: top {share:.0%} tokens ({choice}) at q8_0: KL {value:.5f}", file=sys.stderr, flush=True)
    for top in sorted({1, 3, max(1, layers // 5)}):
        chosen = set(ranked[:top])
        value = kl(lambda at, v, i, chosen=chosen: coded(v, "q4_0" if at in chosen else "q3_0"))
        result["sensitive_layers"].append({"layers": sorted(chosen), "kl": value, "bits": 3.5 + top / layers})
        print(f"{name}: {top} most sensitive layers at q4_0: KL {value:.5f}", file=sys.stderr, flush=True)
    heads = sorted(
        ((row["layer"], h) for row in result["per_head"] for h in range(kv_heads)),
        key=lambda pair: -next(r["kl"][pair[1]] for r in result["per_head"] if r["layer"] == pair[0]),
    )
    for top in sorted({1, 3, max(1, layers * kv_heads // 10)} if kv_heads > 1 else set()):  # (one: the layers')
        chosen = heads[:top]

        def promote(at, v, i, chosen=chosen):
            mine = [h for layer, h in chosen if layer == at]
            return _mixed_heads(v, mine)

        value = kl(promote)
        result["sensitive_heads"].append({"heads": chosen, "kl": value, "bits": 3.5 + top / (layers * kv_heads)})
        print(f"{name}: {top} most sensitive kv heads at q4_0: KL {value:.5f}", file=sys.stderr, flush=True)
    for label, levels, search in (("gaussian", gaussian, False), ("fitted", fitted, False),
                                  ("gaussian, searched scale", gaussian, True)):  # fmt: skip
        value = kl(lambda at, v, i, levels=levels, search=search: coded(v, "q3_0", levels=levels, search=search))
        result["levels"][label] = {"levels": [round(x, 4) for x in levels.tolist()], "kl": value}
        print(f"{name}: {label} levels: KL {value:.5f}", file=sys.stderr, flush=True)
    result["seconds"] = round(time.perf_counter() - started)
    return result


LEVEL_ROWS = {
    "gaussian": "8 Lloyd-Max levels (unit Gaussian) × the block's RMS",
    "fitted": "8 levels fitted to the rotated values × the block's RMS",
    "gaussian, searched scale": "8 Lloyd-Max levels × the block's RMS times the best of 13 factors (0.70-1.30)",
}


def markdown(result: dict) -> str:
    """The summary of one model's measurement."""
    a, layers = result["all_layers"], result["per_layer"]
    ranked = sorted(range(len(layers)), key=lambda i: -layers[i])
    lines = [f"**{result['model']}** ({result['layers']} layers, {result['kv_heads']} kv heads of "
             f"{result['head_dim']}; {result['windows']} × {result['ctx']} tokens):", "",
             "| values | bits a value | KL |", "|---|---:|---:|",
             f"| all layers q8_0 | 8.5 | {a['q8_0']:.5f} |", f"| all layers q4_0 | 4.5 | {a['q4_0']:.5f} |",
             f"| all layers q3_0 | 3.5 | {a['q3_0']:.5f} |"]  # fmt: skip
    seen = []  # (rows that repeat a choice: a small model's shares round to the same count)
    for row in result["sensitive_layers"]:
        if row["layers"] in seen:
            continue
        seen.append(row["layers"])
        lines.append(f"| q3_0, layers {row['layers']} at q4_0 | {row['bits']:.2f} | {row['kl']:.5f} |")
    for row in result.get("sensitive_heads", []) if result["kv_heads"] > 1 else []:  # (one kv head: the layers)
        where = ", ".join(f"{layer}.{head}" for layer, head in row["heads"][:6]) + (", ..." if len(row["heads"]) > 6
                                                                                   else "")  # fmt: skip
        lines.append(f"| q3_0, kv heads (layer.head) {where} at q4_0 | {row['bits']:.2f} | {row['kl']:.5f} |")
    for row in result["tokens"]:
        lines.append(f"| q3_0, top {row['share']:.0%} tokens by attention ({row['choice']}) at q8_0 | "
                     f"{row['bits']:.2f} | {row['kl']:.5f} |")  # fmt: skip
    for label, row in result["levels"].items():
        lines.append(f"| {LEVEL_ROWS.get(label, label)} | 3.5 | {row['kl']:.5f} |")
    share = sum(layers[i] for i in ranked[:3]) / max(sum(layers), 1e-12)
    lines += ["", f"Per layer (only that layer at q3_0): sum {sum(layers):.5f} against {a['q3_0']:.5f} all at once; "
              f"the 3 largest: " + ", ".join(f"layer {i} {layers[i]:.5f}" for i in ranked[:3])
              + f" ({share:.0%} of the sum)."]  # fmt: skip
    for row in result["per_head"][:3]:
        lines.append(f"Layer {row['layer']} by kv head: " + ", ".join(f"{x:.5f}" for x in row["kl"]) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--head-layers", type=int, default=None, help="layers measured by head (most sensitive first)")
    parser.add_argument("--out", default=str(RESULTS / "value_sensitivity.json"))
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    results = []
    for name in args.models.split(","):
        results.append(measure(name, args.ctx, args.windows, args.head_layers))
        print(markdown(results[-1]) + "\n", flush=True)
        with open(args.out, "w") as f:
            json.dump({"text": WIKITEXT_VALID.name, "sinks": SINKS, "window": WINDOW, "results": results}, f, indent=1)
            f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
