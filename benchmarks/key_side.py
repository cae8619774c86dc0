"""Keys' side information below 0.56 bits an element (issue 61, item 3): a measured map.

DeltaKVCache codes keys before RoPE, per channel, in groups of `kf` tokens (`codecs.adaptive`): per group and
channel a range (`low` and `step`, fp16 each) and a depth (4 bits), 36 bits a channel and group: 0.5625 bits a key
element at kf=64, a sixth of a 3.4-bit key. This map measures what cheaper ranges cost in KL, so that bits saved on
the side information can go to the codes, at the same total:

- `fp16`: today's: low and step fp16, the clipped range searched over `CLIPS` (`reference.clipped_codes`);
- `fp8-step`: the step as an 8-bit float (3 mantissa bits, a per-head exponent bias assumed: rounded up, so the
  range still fits), low fp16: 28 bits;
- `fp8`: low rounded down and step up to 8-bit floats: 20 bits;
- `gridN`: per sequence a base range per channel (its min and max over the prompt: here the window's first half,
  fp16, 4 bytes a channel spread over the window), and per group low and high as N-bit codes on a grid from `--margin`
  of that range below it to as much above (low rounded down, high up; beyond the grid the group is clipped): 2N + 4
  bits. `key_side.json` was measured at a margin of 0.25 (`--margin 0.25`), the cache's grid's first; the cache now
  reaches 2.0 (`key_grid.GRID_MARGIN`, the default here), which a short prompt needs;
- `static`: the base range alone, no range per group (its depth per group): 4 bits.

Every variant searches the same clipped candidates (`CLIPS`) through its own rounding and keeps the one of least
squared error, then codes the group against the range it stores. Depths: `reference.allocate_bits` of each channel's
range squared times the mean pair energy of the queries before the group (`codecs.adaptive`'s weights; the first
group weighs all channels alike).

Protocol (`value_sensitivity.py`'s, for keys): an attention function registered through `AttentionInterface` turns
each layer's keys back to before RoPE (`rope.RopeForm`, as the cache does), codes them in groups of `kf` aligned to
position 0 (the first `SINKS` tokens then restored exact), turns them forward again, and runs SDPA with values exact;
the KL divergence from the unmodified model over WikiText-2 validation windows. Bits a key element: the code bits
plus the side information per group over `kf`, plus the per-sequence base ranges spread over the window.

    python benchmarks/key_side.py                         # SmolLM2, Gemma 3, Qwen2.5-Coder-0.5B
    python benchmarks/key_side.py --models smollm2-135m --windows 1
Written to benchmarks/results/key_side.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch
from paths import RESULTS, WIKITEXT_VALID, machine
from value_sensitivity import SINKS

from hf_deltakv.kernels.key_grid import GRID_MARGIN as MARGIN  # (the codec's grid reaches as far; --margin)
from hf_deltakv.kernels.reference import CLIPS, allocate_bits, query_energy

PROBE = "hf_deltakv_key_side"
RATES = (2.5, 2.75, 3.0, 3.25, 3.5)  # code bits a key element
DEPTH_BITS = 4  # a channel's depth per group (`quant.pack_4bit`)
# variant -> side bits a channel and group (depth included); per-sequence base bits a channel
VARIANTS = {"fp16": (36, 0), "fp8-step": (28, 0), "fp8": (20, 0), "grid8": (20, 32), "grid6": (16, 32),
            "grid4": (12, 32), "static": (DEPTH_BITS, 32)}  # fmt: skip
FP8_MANTISSA = 3


def minifloat(x: torch.Tensor, up: bool) -> torch.Tensor:
    """`x` rounded to a float of `FP8_MANTISSA` mantissa bits (exponent unbounded: a per-head bias assumed), up
    (toward +inf) or down."""
    _, exponent = torch.frexp(x)
    unit = torch.ldexp(torch.ones_like(x), exponent - 1 - FP8_MANTISSA)
    scaled = x / unit
    return (scaled.ceil() if up else scaled.floor()) * unit


def stored_range(variant: str, low: torch.Tensor, high: torch.Tensor, levels: torch.Tensor, base: tuple | None):
    """The (low, step) fp32 a variant stores for wanted ranges `[low, high]`, rounded as its format holds them."""
    if variant == "fp16":
        low16 = low.half().float()
        return low16, ((high - low16) / levels).clamp_min(0).half().float()
    if variant == "fp8-step":
        low16 = low.half().float()
        return low16, minifloat(((high - low16) / levels).clamp_min(0), up=True)
    if variant == "fp8":
        low8 = minifloat(low, up=False)
        return low8, minifloat(((high - low8) / levels).clamp_min(0), up=True)
    bottom, top = base
    if variant == "static":
        return bottom.expand_as(low), ((top - bottom) / levels).expand_as(low)
    codes = (1 << int(variant.removeprefix("grid"))) - 1
    origin = bottom - MARGIN * (top - bottom)
    unit = ((1 + 2 * MARGIN) * (top - bottom) / codes).clamp_min(1e-12)
    lo = ((low - origin) / unit).floor().clamp(0, codes)
    hi = ((high - origin) / unit).ceil().clamp(0, codes)
    hi = torch.maximum(hi, lo)
    return origin + lo * unit, (hi - lo) * unit / levels


def code_groups(x: torch.Tensor, weights: torch.Tensor, bits: float, variant: str, base: tuple | None):
    """Groups `x` fp32 `[B, H, G, kf, D]` coded and decoded: depths from the ranges and `weights` `[B, H, G, D]`, each
    channel's range the candidate of `CLIPS` of least squared error as the variant stores it."""
    dim = x.shape[-1]
    low, high = x.amin(3), x.amax(3)
    span = high - low
    depths = allocate_bits(span.pow(2) * weights, round(bits * dim)).long()
    levels = ((1 << depths) - 1).float()
    clips = CLIPS.to(x.device)
    lows = low.unsqueeze(-1) + clips[:, 0] * span.unsqueeze(-1)  # [B, H, G, D, C]
    highs = low.unsqueeze(-1) + span.unsqueeze(-1) * (1 - clips[:, 1])
    if base is not None:
        base = tuple(b[:, :, None, :, None] for b in base)
    lows, steps = stored_range(variant, lows, highs, levels.unsqueeze(-1), base)
    if variant == "static":  # (one range: nothing to search)
        lows, steps = lows[..., :1], steps[..., :1]
    top = levels.unsqueeze(-1).unsqueeze(-3)

    def decoded(low_c, step_c):
        inverse = torch.where(step_c > 0, 1.0 / step_c, torch.zeros_like(step_c))
        codes = torch.minimum(((x.unsqueeze(-1) - low_c) * inverse).round().clamp_min(0), top)
        return codes * step_c + low_c

    out = decoded(lows.unsqueeze(-3), steps.unsqueeze(-3))  # [B, H, G, kf, D, C]
    best = (out - x.unsqueeze(-1)).square().sum(3, keepdim=True).argmin(-1, keepdim=True)
    return out.gather(-1, best.expand(*out.shape[:-1], 1)).squeeze(-1)


class Probe:
    """The attention function: codes each layer's keys (`code`: (layer, query, key) -> key) before SDPA."""

    def __init__(self) -> None:
        self.code = None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.code is not None:
            key = self.code(module.layer_idx, query, key)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.no_grad()
def measure(name: str, ctx: int, windows: int, kf: int, variants: list[str], rates: list[float]) -> dict:
    from transformers import AttentionInterface

    from hf_deltakv.cache import rope_forms
    from hf_deltakv.eval.perplexity import token_windows
    from hf_deltakv.models import load_model

    model, tokenizer = load_model(name)
    model.float()
    forms = rope_forms(model, required=True)
    probe = Probe()
    AttentionInterface.register(PROBE, probe)
    model.set_attn_implementation(PROBE)
    config = model.config.get_text_config(decoder=True)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    started = time.perf_counter()
    ids = tokenizer(WIKITEXT_VALID.read_text(), return_tensors="pt").input_ids[0]
    measured = [w[None] for w in token_windows(ids, ctx, windows)]
    reference = [model(w).logits[0, :-1].float().log_softmax(-1) for w in measured]

    def coder(variant: str, bits: float):
        def code(layer, query, key):
            form = forms[layer]
            batch, heads, tokens, _ = key.shape
            positions = torch.arange(tokens, device=key.device).expand(batch, tokens)
            pre = key.float() if form is None else form.undo(key, positions)
            groups = tokens // kf
            x = pre[:, :, : groups * kf].unflatten(2, (groups, kf))
            energy = query_energy(query, None if form is None else form.order, heads, False)
            before = torch.cat([torch.zeros_like(energy[:, :, :1]), energy.cumsum(2)], 2)[:, :, 0 : groups * kf : kf]
            counts = torch.arange(0, groups * kf, kf, device=key.device).clamp_min(1).float()[:, None]
            weights = before / counts
            weights[:, :, 0] = 1.0  # (the first group: no query seen, every channel alike)
            prompt = pre[:, :, : tokens // 2]
            base = (prompt.amin(2), prompt.amax(2))
            coded = pre.clone()
            coded[:, :, : groups * kf] = code_groups(x, weights, bits, variant, base).flatten(2, 3)
            coded[:, :, :SINKS] = pre[:, :, :SINKS]
            out = coded if form is None else form.redo(coded, positions)
            return out.to(key.dtype)

        return code

    def kl(code) -> float:
        total = count = 0.0
        probe.code = code
        for w, ref in zip(measured, reference, strict=True):
            logprobs = model(w).logits[0, :-1].float().log_softmax(-1)
            total += (ref.exp() * (ref - logprobs)).sum().item()
            count += logprobs.shape[0]
        probe.code = None
        return total / count

    rows = []
    for variant in variants:
        side, per_sequence = VARIANTS[variant]
        for bits in rates:
            total = bits + side / kf + per_sequence / ctx
            value = kl(coder(variant, bits))
            rows.append({"variant": variant, "code_bits": bits, "side_bits": side / kf,
                         "sequence_bits": per_sequence / ctx, "bits": total, "kl": value})  # fmt: skip
            print(f"{name}: {variant} @ {bits} code bits ({total:.3f} bits): KL {value:.5f}", file=sys.stderr,
                  flush=True)  # fmt: skip
    return {"model": name, "head_dim": dim, "layers": config.num_hidden_layers, "ctx": ctx, "windows": windows,
            "kf": kf, "measured_on": WIKITEXT_VALID.name, "rows": rows,
            "seconds": round(time.perf_counter() - started)}  # fmt: skip


def at_bits(rows: list[dict], variant: str, bits: float) -> float | None:
    """The variant's KL at `bits` a key element, interpolated in log KL between its measured points (None
    outside them)."""
    points = sorted((r["bits"], r["kl"]) for r in rows if r["variant"] == variant)
    for (b0, k0), (b1, k1) in itertools.pairwise(points):
        if b0 <= bits <= b1:
            t = (bits - b0) / (b1 - b0)
            return math.exp(math.log(k0) * (1 - t) + math.log(k1) * t)
    return None


def markdown(result: dict) -> str:
    rows = result["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    rates = list(dict.fromkeys(r["code_bits"] for r in rows))
    lines = [f"**{result['model']}** ({result['layers']} layers, head_dim {result['head_dim']}; kf={result['kf']}, "
             f"{result['windows']} × {result['ctx']} tokens of {result['measured_on']}): KL of keys alone, and the "
             "bits a key element (codes, side information, per-sequence base ranges)", "",
             "| side information | bits a channel and group | " + " | ".join(f"{b} code bits" for b in rates)
             + " | KL at 3.3 / 3.6 bits (interpolated) |",
             "|---|---:|" + "---:|" * (len(rates) + 1)]  # fmt: skip
    for variant in variants:
        mine = {r["code_bits"]: r for r in rows if r["variant"] == variant}
        cells = [f"{mine[b]['bits']:.3f}: {mine[b]['kl']:.4f}" if b in mine else "–" for b in rates]
        inter = [at_bits(rows, variant, b) for b in (3.3, 3.6)]
        inter_text = " / ".join("–" if v is None else f"{v:.4f}" for v in inter)
        lines.append(f"| {variant} | {VARIANTS[variant][0]} | " + " | ".join(cells) + f" | {inter_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global MARGIN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--kf", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rates", default=",".join(str(r) for r in RATES))
    parser.add_argument("--margin", type=float, default=MARGIN, help="the grids' reach beyond the fitted range")
    parser.add_argument("--out", default=str(RESULTS / "key_side.json"))
    args = parser.parse_args(argv)
    MARGIN = args.margin
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: {sorted(VARIANTS)}")
    rates = [float(r) for r in args.rates.split(",")]
    results = [measure(m, args.ctx, args.windows, args.kf, variants, rates) for m in args.models.split(",") if m]
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "margin": MARGIN, "results": results}, f, indent=1)
    for result in results:
        print(markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
