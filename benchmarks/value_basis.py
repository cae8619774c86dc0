"""Values below four bits in each head's own directions (issue 61, step 1): a measured map.

Per model: the eigen-spectrum of every (layer, kv head)'s values, the gain a per-head basis with bits spread by reverse
water-filling predicts, and the KL divergence from the unmodified model when only values are coded (keys exact, the
first `SINKS` tokens raw: `value_sensitivity.py`'s protocol, an attention function registered through
`AttentionInterface` codes the values before SDPA in one forward per window), for these coders:

- `q3_0-rot`, `q4_0-rot`: today's values (block Hadamard, q3_0/q4_0 with searched scales: 3.5/4.5 bits a value);
- `mean+q3_0-rot`: the head's mean value removed first (stored once per head, added back);
- `norm-rot`: the block Hadamard, one fp16 scale per token and head (16/head_dim bits) in place of one per 32 values,
  each coordinate at the same integer bits (the rest of the rate spread one bit at a time);
- `mean+norm-rot`: both;
- `basis@R`: the head's mean removed, its principal directions (the eigenvectors of its values' covariance), one fp16
  scale per token, bits per direction (0-8) spread by reverse water-filling over the eigenvalues to a mean of `R`
  bits a value, the scale included;
- `basis-flat@R`: the same directions, every one at the same bits (the basis without the allocation);
- `basis-nomean@R`: the basis without removing the mean;
- `basis-wo@R`: the directions weighted by what reaches the output: the eigenvectors of `M^1/2 C M^1/2`, `C` the
  values' covariance and `M` the sum over the kv head's query heads of `W_o`'s head block `W^T W` (a generalized
  eigenproblem: the error measured after `o_proj`);
- `+fallback`: per token and kv head, whichever of the basis's coding and today's rotated blocks at the same rate
  (`q3_0-rot` at 3.5, `q4_0-rot` at 4.5) errs less in squared error, a flag bit per token and head counted (a token
  far out in a direction the fit barely saw coarsens every direction of its basis coding; the blocks' scales follow
  it);
- `(self)`: the basis, mean and bits fitted on each measured window's own values (what a cache fitting at prefill
  from the prompt would have for the prompt's tokens; the others are calibrated on another text); `(prefix)`: fitted
  on the window's first half, used for all of it (a prompt's basis serving the tokens decoded after it); `(spreads:
  self)`, `(spreads: prefix)`: the directions calibrated on another text (a per-model table), the mean, the spreads
  along them and so the bits fitted on the window (or its first half);
- `table=int8`: the basis matrix held in 8 bits (an fp16 scale a direction), the coder applying that matrix.

Options of the coders in `VARIANTS` (the label says them): `scale=max` (a token's scale from its largest coefficient,
nothing clipped, as a q3_0 block's; default: from its RMS, the Gaussian quantizer clipping the tails), `floor=N`
(every direction at least N bits: none dropped).

Each direction's coefficient is divided by the token's scale (fp16: the multiple of its coefficients' RMS among
`SCALE_SEARCH`, or with `scale=max` of their largest among `MAX_SEARCH`, that errs least, as q3_0's scale is
searched; `scale=max` also tries `RMS_IN_MAX` multiples of their RMS, which clip one direction's excursion rather than
coarsen every direction for it) and the direction's calibrated spread, then quantized at its bits by the uniform
quantizer of least error for a unit Gaussian (`scale=max`: 2^b levels evenly over ± 1; 0 bits: dropped).
Calibration: `--calib` (default the Python standard library's code) for `--calib-windows` windows of `--ctx` tokens;
measurement: WikiText-2 validation windows (tuning never reads test). Bits count the codes and the per-token scale (or
the block scales). The per-model tables (a head_dim² matrix, a mean and the bits per head) are reported in bytes, not
spread over tokens. What a cache fitting at prefill holds per sequence and kv head (`table_bytes`: the matrix, or for
`spreads` only the mean, spreads and bits) is not in the first bits column either: the tables' column spreads it over
the window's tokens and over 8K and 32K (a prompt's tables serve every token of the sequence).

Predicted gain per head at high rate: ½·log₂(AM/GM) of the eigenvalues; at rate R: ½·log₂ of the squared error of a
flat spectrum over that of the water-filled one, both with the same integer quantizers.

    python benchmarks/value_basis.py                              # SmolLM2, Gemma 3, Qwen2.5-Coder-0.5B
    python benchmarks/value_basis.py --models smollm2-135m --windows 1 --ctx 512
Written to benchmarks/results/value_basis.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
from paths import RESULTS, WIKITEXT_VALID, machine
from value_sensitivity import SINKS, coded, rotated_blocks

from hf_deltakv.kernels.basis import (  # (the codec's reference: these are its quantizers, allocation, fallback)
    FALLBACK,
    MAX_SEARCH,
    RMS_IN_MAX,
    WEIGHT_FLOOR,
    allocate,
    gaussian_quantizers,
)
from hf_deltakv.kernels.hadamard import rotate
from hf_deltakv.quant import FP16_MAX

PROBE = "hf_deltakv_value_basis"
RATES = (2.5, 3.0, 3.5, 4.5)  # (the predicted gains' rates)
# The coders measured beside today's (`fit`'s kinds and options; `self`: fitted on the measured window's values)
VARIANTS = (
    {"kind": "norm-rot"},
    {"kind": "norm-rot", "options": {"scale": "max"}},
    {"kind": "mean+norm-rot", "options": {"scale": "max"}},
    {"kind": "basis"},
    {"kind": "basis", "options": {"scale": "max"}},
    {"kind": "basis", "options": {"scale": "max", "floor": 2}},
    {"kind": "basis-flat", "options": {"scale": "max"}},
    {"kind": "basis-nomean", "options": {"scale": "max", "floor": 2}},
    {"kind": "basis-wo", "options": {"scale": "max", "floor": 2}},
    {"kind": "basis", "self": True},
    {"kind": "basis", "self": True, "options": {"scale": "max"}},
    {"kind": "basis", "self": True, "options": {"scale": "max", "floor": 2}},
    {"kind": "basis", "self": "prefix", "options": {"scale": "max", "floor": 2}},
    {"kind": "basis", "self": True, "rate": 2.5, "options": {"scale": "max", "floor": 1}},
    {"kind": "basis", "self": True, "rate": 3.0, "options": {"scale": "max", "floor": 2}},
    {"kind": "basis", "self": True, "rate": 4.5, "options": {"scale": "max", "floor": 2}},
    {"kind": "basis", "self": True, "options": {"scale": "max", "floor": 2}, "fallback": True},
    {"kind": "basis", "self": "prefix", "options": {"scale": "max", "floor": 2}, "fallback": True},
    {"kind": "basis", "self": True, "rate": 4.5, "options": {"scale": "max", "floor": 2}, "fallback": True},
    {"kind": "basis", "options": {"scale": "max", "floor": 2}, "fallback": True},
    {"kind": "basis", "self": "spreads", "options": {"scale": "max", "floor": 2}, "fallback": True},
    {"kind": "basis", "self": "spreads-prefix", "options": {"scale": "max", "floor": 2}, "fallback": True},
    {"kind": "basis", "self": "prefix", "options": {"scale": "max", "floor": 2, "table": "int8"}, "fallback": True},
    {"kind": "basis", "rate": 3.0, "options": {"scale": "max", "floor": 2}},
    {"kind": "basis", "rate": 4.5, "options": {"scale": "max", "floor": 2}},
)
NORM_BITS = 16  # one fp16 scale per token and head
SCALE_SEARCH = (0.8, 1.0, 1.25, 1.6, 2.0, 2.5, 3.2, 4.0)  # multiples of a token's RMS tried as its scale
TABLE_AT = (8192, 32768)  # context lengths the per-sequence tables are also spread over in the tables


STEPS, ERRORS = gaussian_quantizers()


def budget(rate: float, dim: int) -> int:
    """Code bits of one token and head at `rate` bits a value, its fp16 scale counted."""
    return round((rate - NORM_BITS / dim) * dim)


class HeadCoders:
    """Every kv head of a layer coded in its own directions: `forward` `[H, D, D]` maps a value less `mean` `[H, D]` to
    coefficients, `inverse` maps them back, `spread` `[H, D]` their calibrated standard deviations, `bits` `[H, D]`;
    `scale` `rms` (a token's scale a multiple of its coefficients' RMS, each direction's quantizer the Gaussian one:
    large coefficients clipped) or `max` (a multiple up to 1 of the largest coefficient over its direction's spread,
    each direction's 2^b levels spread evenly over ± that: nothing clipped at 1, as a q3_0 block's scale). Both
    quantizers are midrise (no level at zero)."""

    def __init__(self, mean, forward, inverse, spread, bits, scale: str = "rms") -> None:
        self.mean, self.forward, self.inverse, self.spread, self.bits = mean, forward, inverse, spread, bits
        self.scale = scale

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """`values` `[B, H, T, D]` coded and decoded (fp32): each token's coefficients over its scale (fp16, the
        multiple in `SCALE_SEARCH` or `MAX_SEARCH` of their RMS or largest whose coding errs least in the
        coefficients' domain) times each direction's calibrated spread, quantized at the direction's bits."""
        x = values.float() - self.mean[:, None]
        y = torch.einsum("bhtd,hed->bhte", x, self.forward)
        weight = self.spread / self.spread.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)  # RMS 1
        # (a direction the fit saw almost nothing in keeps a thousandth of the mean spread: a later token's excursion
        # there must not make its scale overflow fp16)
        weight = weight.clamp_min(WEIGHT_FLOOR)[:, None]
        half = (2.0 ** (self.bits - 1).clamp_min(0)).float()[:, None]
        kept = self.bits[:, None] > 0
        if self.scale == "rms":
            rms = y.pow(2).mean(-1, keepdim=True).sqrt()
            sizes = [rms * multiple for multiple in SCALE_SEARCH]
            steps = torch.tensor(STEPS, dtype=torch.float32)[self.bits][:, None]  # [H, 1, D]
        else:  # (the largest coefficient over its direction's spread, among the directions kept; or, where one
            # direction's excursion would coarsen all the others, a multiple of their RMS, that one clipped)
            relative = torch.where(kept, y.abs() / weight, 0)
            largest = relative.amax(-1, keepdim=True)
            # (RMS over the directions relative to their spreads, and of the coefficients themselves: the weights' RMS
            # is 1, so a typical direction's size even where one direction the fit barely saw is far out)
            typical = [relative.pow(2).mean(-1, keepdim=True).sqrt(), y.pow(2).mean(-1, keepdim=True).sqrt()]
            sizes = [largest * m for m in MAX_SEARCH] + [torch.minimum(t * m, largest) for t in typical
                                                         for m in RMS_IN_MAX]  # fmt: skip
            steps = torch.where(kept, 1 / half, 0.0)
        best = best_error = None
        for size in sizes:
            scale = size.clamp_max(FP16_MAX).half().float().clamp_min(1e-30) * weight
            code = torch.minimum(torch.maximum(torch.floor(y / (scale * steps).clamp_min(1e-30)), -half), half - 1)
            decoded = torch.where(kept, (code + 0.5) * steps * scale, torch.zeros_like(y))
            error = (decoded - y).pow(2).sum(-1, keepdim=True)
            if best is None:
                best, best_error = decoded, error
            else:
                better = error < best_error
                best, best_error = torch.where(better, decoded, best), torch.minimum(error, best_error)
        return torch.einsum("bhte,hed->bhtd", best, self.inverse) + self.mean[:, None]


class Fallback:
    """`coder` (a `HeadCoders`) or, per token and kv head, the rotated blocks of `fmt` where they err less in squared
    error (what one flag bit per token and head selects)."""

    def __init__(self, coder: HeadCoders, fmt: str) -> None:
        self.coder, self.fmt = coder, fmt
        self.tokens = self.fallen = 0  # (how many token-heads took the blocks)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        x = values.float()
        basis = self.coder(values)
        blocks = rotated_blocks(x, self.fmt)
        worse = (basis - x).pow(2).sum(-1, keepdim=True) > (blocks - x).pow(2).sum(-1, keepdim=True)
        self.tokens += worse.numel()
        self.fallen += int(worse.sum())
        return torch.where(worse, blocks, basis)


def fit(stats: dict, rate: float, kind: str, metric: torch.Tensor | None = None, floor: int = 0,
        scale: str = "rms", directions: torch.Tensor | None = None, table: str = "fp16") -> HeadCoders:  # fmt: skip
    """The coders of one layer from its values' statistics (`count`, `sum` `[H, D]`, `outer` `[H, D, D]`, float64):
    `kind` `basis`, `basis-flat`, `basis-nomean`, `basis-wo` (with `metric` `[H, D, D]`), `norm-rot`,
    `mean+norm-rot`; every direction at least `floor` bits; `scale` as `HeadCoders`. `directions` `[H, D, D]` (kind
    `basis`: orthonormal columns, another fit's): kept, only the mean, the spreads along them and the bits fitted
    here. `table` `int8`: the basis matrix as a decoder would hold it in 8 bits (each direction's entries over one
    scale, `int8_rows`), the coder applying that matrix both ways."""
    count, total, outer = stats["count"], stats["sum"], stats["outer"]
    heads, dim = total.shape
    mean = total / count
    centred = "nomean" not in kind and kind != "norm-rot"
    second = outer / count - (mean[:, :, None] * mean[:, None, :] if centred else 0)
    if not centred:
        mean = torch.zeros_like(mean)
    # y = F x (F: `forward` [H, e, d]); x = R y (R [H, d, e]); `HeadCoders` takes R transposed
    if kind == "basis-wo":
        eigen, vectors = torch.linalg.eigh(metric)
        eigen = eigen.clamp_min(eigen[:, -1:] * 1e-6)  # (a ridge: the metric made invertible)
        root = vectors @ torch.diag_embed(eigen.sqrt()) @ vectors.transpose(1, 2)
        root_inverse = vectors @ torch.diag_embed(eigen.rsqrt()) @ vectors.transpose(1, 2)
        variance, basis = torch.linalg.eigh(root @ second @ root)
        forward, back = basis.transpose(1, 2) @ root, root_inverse @ basis
    elif kind == "basis" and directions is not None:
        basis = directions.double()
        variance = torch.einsum("hde,hdf,hfe->he", basis, second, basis)
        forward, back = basis.transpose(1, 2), basis
    elif kind.startswith("basis"):
        variance, basis = torch.linalg.eigh(second)
        forward, back = basis.transpose(1, 2), basis
        if kind == "basis-flat":  # (the directions alone: every one the same bits)
            variance = variance.clamp_min(0).mean(-1, keepdim=True).expand(heads, dim)
    else:  # the block Hadamard (symmetric, its own inverse): every direction the same spread
        hadamard = rotate(torch.eye(dim, dtype=torch.float32)).double()
        forward = back = hadamard.expand(heads, dim, dim)
        variance = torch.einsum("hed,hdf,hef->he", forward, second, forward)
        variance = variance.mean(-1, keepdim=True).expand(heads, dim)
    variance = variance.clamp_min(0)
    bits = torch.stack([allocate(v, budget(rate, dim), floor) for v in variance])
    if table == "int8":  # (orthonormal bases only: the rounded matrix is applied both ways)
        forward = int8_rows(forward)
        back = forward.transpose(1, 2)
    return HeadCoders(mean.float(), forward.float(), back.transpose(1, 2).float(), variance.sqrt().float(), bits,
                      scale)  # fmt: skip


def int8_rows(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` `[H, e, d]` as 8-bit codes times one fp16 scale per row `e` (a direction), decoded."""
    scale = (matrix.abs().amax(-1, keepdim=True) / 127).half().double().clamp_min(1e-30)
    return torch.round(matrix / scale).clamp(-127, 127) * scale


def table_bytes(kind: str, dim: int, fitted: str, table: str = "fp16") -> int:
    """Bytes of one kv head's tables that a cache fitting at prefill holds per sequence (`fitted`: `model`, calibrated
    once per model: none; `sequence`: the basis matrix (fp16, or int8 with an fp16 scale a direction), the mean and
    spreads in fp16, a byte of bits a direction; `spreads`: the directions calibrated per model, the mean, spreads and
    bits per sequence)."""
    if fitted == "model" or "basis" not in kind:
        return 0
    small = 2 * dim * 2 + dim  # (mean and spreads in fp16, a byte of bits a direction: as `codecs.basis` holds them)
    if fitted == "spreads":
        return small
    return small + (dim * dim + 2 * dim if table == "int8" else 2 * dim * dim)


def predicted_gain(variance: torch.Tensor, rate: float) -> float:
    """½·log₂(error of a flat spectrum / error of the water-filled one) at `rate`, the same quantizers."""
    dim = variance.shape[0]
    errors = torch.tensor(ERRORS, dtype=torch.float64)
    v = variance.double().clamp_min(0)
    flat = v.mean().expand(dim)
    spent = [errors[allocate(s, budget(rate, dim))] @ s for s in (flat, v)]
    return 0.5 * math.log2(float(spent[0]) / max(float(spent[1]), 1e-300))


def am_gm_bits(variance: torch.Tensor) -> float:
    """½·log₂(arithmetic / geometric mean) of the eigenvalues (the high-rate gain of a basis; floors at 1e-12 of the
    largest)."""
    v = variance.double().clamp_min(float(variance.max()) * 1e-12)
    return 0.5 * math.log2(float(v.mean()) / math.exp(float(v.log().mean())))


class Probe:
    """The attention function: records each layer's values (`record`) or codes them (`code`) before SDPA."""

    def __init__(self) -> None:
        self.code = None  # (layer, values) -> values
        self.stats: dict[int, dict] | None = None  # layer -> count, sum, outer (float64)
        self.tokens: int | None = None  # the first tokens recorded (None: all)
        # squared error and energy of the coded values, and of the attention's output after `o_proj`
        self.mse: list[float] | None = None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        if self.stats is not None:
            x = value[0, :, SINKS : self.tokens].double()  # [H, T, D]
            s = self.stats.setdefault(layer, {"count": 0, "sum": 0.0, "outer": 0.0})
            s["count"] += x.shape[1]
            s["sum"] = s["sum"] + x.sum(1)
            s["outer"] = s["outer"] + x.transpose(1, 2) @ x
        if self.code is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        coded_values = self.code(layer, value)
        out = sdpa_attention_forward(module, query, key, coded_values, attention_mask, **kwargs)
        if self.mse is not None:
            exact = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]
            through = [module.o_proj(o.reshape(*o.shape[:2], -1)).float()[:, SINKS:] for o in (out[0], exact)]
            self.mse[0] += float((coded_values.float() - value.float())[:, :, SINKS:].pow(2).sum())
            self.mse[1] += float(value.float()[:, :, SINKS:].pow(2).sum())
            self.mse[2] += float((through[0] - through[1]).pow(2).sum())
            self.mse[3] += float(through[1].pow(2).sum())
        return out


def output_metric(model, layer: int, kv_heads: int, dim: int) -> torch.Tensor:
    """`[kv_heads, D, D]`: for each kv head, the sum over its query heads of `W^T W`, `W` the head's block of the
    layer's `o_proj` (float64)."""
    attention = model.model.layers[layer].self_attn
    weight = attention.o_proj.weight.detach().double()  # [hidden, q_heads * D]
    q_heads = weight.shape[1] // dim
    blocks = weight.view(weight.shape[0], q_heads, dim).permute(1, 2, 0)  # [q_heads, D, hidden]
    per_query = blocks @ blocks.transpose(1, 2)
    return per_query.view(kv_heads, q_heads // kv_heads, dim, dim).sum(1)


@torch.no_grad()
def measure(name: str, ctx: int, windows: int, calib: str, calib_windows: int, only: str | None = None) -> dict:
    from transformers import AttentionInterface

    from hf_deltakv.eval.perplexity import token_windows
    from hf_deltakv.eval.texts import load_text
    from hf_deltakv.models import load_model

    model, tokenizer = load_model(name)
    model.float()
    probe = Probe()
    AttentionInterface.register(PROBE, probe)
    model.set_attn_implementation(PROBE)
    config = model.config.get_text_config(decoder=True)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    started = time.perf_counter()

    def windows_of(text: str, count: int) -> list[torch.Tensor]:
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        return [w[None] for w in token_windows(ids, ctx, count)]

    probe.stats = {}
    for w in windows_of(load_text(calib), calib_windows):
        model(w)
    calibration, probe.stats = probe.stats, None
    measured = windows_of(WIKITEXT_VALID.read_text(), windows)
    reference = [model(w).logits[0, :-1].float().log_softmax(-1) for w in measured]
    own, own_prefix = [], []  # each measured window's own statistics (the prompt-fitted basis), and its first half's
    for w in measured:
        for target, tokens in ((own, None), (own_prefix, w.shape[1] // 2)):
            probe.stats, probe.tokens = {}, tokens
            model(w)
            target.append(probe.stats)
    probe.stats, probe.tokens = None, None
    metrics = {layer: output_metric(model, layer, kv_heads, dim) for layer in range(layers)}

    def kl(code) -> tuple[float, float, float]:
        """Mean KL per predicted token with `code(layer, values, window)` on every layer, the values' relative squared
        error, and that of each layer's attention output after `o_proj` (the coded layer's alone: the exact values'
        output computed beside it)."""
        total = count = 0.0
        probe.mse = [0.0, 0.0, 0.0, 0.0]
        for i, w in enumerate(measured):
            probe.code = lambda layer, values, i=i: code(layer, values, i)
            logprobs = model(w).logits[0, :-1].float().log_softmax(-1)
            ref = reference[i]
            total += (ref.exp() * (ref - logprobs)).sum().item()
            count += logprobs.shape[0]
        probe.code = None
        error, energy, output_error, output = probe.mse
        probe.mse = None
        return total / count, error / max(energy, 1e-30), output_error / max(output, 1e-30)

    def keep_sinks(coder):
        def code(layer, values, i):
            out = values.float().clone()
            out[:, :, SINKS:] = coder(layer, i)(values[:, :, SINKS:])
            return out.to(values.dtype)

        return code

    # The map: spectra, predicted gains, the mean's share of the energy.
    heads = []
    calibrated_directions = {}  # layer -> the calibration's eigenvectors `[H, D, D]` (columns; `spreads` variants)
    for layer in range(layers):
        s = calibration[layer]
        mean = s["sum"] / s["count"]
        second = s["outer"] / s["count"]
        covariance = second - mean[:, :, None] * mean[:, None, :]
        calibrated_directions[layer] = torch.linalg.eigh(covariance)[1]
        for head in range(kv_heads):
            eigen = torch.linalg.eigvalsh(covariance[head]).flip(0).clamp_min(0)
            energy = float(torch.diagonal(second[head]).sum())
            heads.append({"layer": layer, "head": head, "eigenvalues": [float(f"{x:.4g}") for x in eigen],
                          "am_gm_bits": am_gm_bits(eigen), "mean_share": float(mean[head].pow(2).sum()) / energy,
                          "gain_bits": {str(r): predicted_gain(eigen, r) for r in RATES}})  # fmt: skip
    result = {"model": name, "layers": layers, "kv_heads": kv_heads, "head_dim": dim, "ctx": ctx, "windows": windows,
              "calibration": {"text": calib, "windows": calib_windows}, "measured_on": WIKITEXT_VALID.name,
              "heads": heads, "variants": []}  # fmt: skip
    # a per-model table (calibrated bases): fp16 matrix and mean, a byte of bits a direction
    result["table_bytes_per_layer"] = 2 * kv_heads * (dim * dim + dim) + kv_heads * dim

    def add(label: str, bits: float, code, coders: list | None = None) -> None:
        if only and only not in label:
            return
        value, mse, output_mse = kl(code)
        result["variants"].append({"variant": label, "bits": bits, "kl": value, "value_mse": mse,
                                   "output_mse": output_mse})  # fmt: skip
        fallen = [c for c in coders or [] if isinstance(c, Fallback)]
        if fallen:  # (the share of token-heads the blocks coded)
            result["variants"][-1]["fallback_share"] = sum(c.fallen for c in fallen) / sum(c.tokens for c in fallen)
        print(f"{name}: {label} ({bits:.3f} bits): KL {value:.5f}, value MSE {mse:.4f}, output MSE {output_mse:.4f}",
              file=sys.stderr, flush=True)  # fmt: skip

    means = {layer: (calibration[layer]["sum"] / calibration[layer]["count"]).float() for layer in range(layers)}
    add("q3_0-rot", 3.5, lambda layer, v, i: coded(v, "q3_0"))
    add("q4_0-rot", 4.5, lambda layer, v, i: coded(v, "q4_0"))
    add("mean+q3_0-rot", 3.5,
        lambda layer, v, i: (coded(v.float() - means[layer][None, :, None], "q3_0")
                             + means[layer][None, :, None]).to(v.dtype))  # fmt: skip
    for spec in VARIANTS:
        kind, rate, options = spec["kind"], spec.get("rate", 3.5), spec.get("options", {})
        label = kind + "".join(f"/{k}={v}" for k, v in options.items()) + (f"@{rate}" if "basis" in kind else "")
        bits, fallback = rate, bool(spec.get("fallback"))

        def made(stats, layer, rate=rate, kind=kind, options=options, fallback=fallback, directions=None):
            given = None if directions is None else directions[layer]
            coder = fit(stats, rate, kind, metrics[layer], directions=given, **options)
            return Fallback(coder, FALLBACK[rate]) if fallback else coder

        if fallback:
            label, bits = label.replace("@", "+fallback@"), rate + 1 / dim
        fitted_on = spec.get("self")
        if fitted_on:  # fitted on each measured window's own values (its first half: "prefix"; "spreads": the
            # directions calibrated, the mean, spreads and bits from the window)
            source = own_prefix if str(fitted_on).endswith("prefix") else own
            if str(fitted_on).startswith("spreads"):
                made = functools.partial(made, directions=calibrated_directions)
            selves = [{layer: made(o[layer], layer) for layer in range(layers)} for o in source]
            tag = {True: "self", "prefix": "prefix", "spreads": "spreads: self", "spreads-prefix": "spreads: prefix"}
            add(f"{label} ({tag[fitted_on]})", bits, keep_sinks(lambda layer, i, selves=selves: selves[i][layer]),
                [c for s in selves for c in s.values()])  # fmt: skip
        else:
            fitted = {layer: made(calibration[layer], layer) for layer in range(layers)}
            add(label, bits, keep_sinks(lambda layer, i, fitted=fitted: fitted[layer]), list(fitted.values()))
    result["seconds"] = round(time.perf_counter() - started)
    return result


def summary(result: dict) -> dict:
    """Median, mean and largest predicted gains and mean shares over the heads."""
    heads = result["heads"]

    def stats(values: list[float]) -> dict:
        ordered = sorted(values)
        return {"median": ordered[len(ordered) // 2], "mean": sum(values) / len(values), "max": ordered[-1]}

    return {"am_gm_bits": stats([h["am_gm_bits"] for h in heads]),
            "gain_bits_3.5": stats([h["gain_bits"]["3.5"] for h in heads]),
            "mean_share": stats([h["mean_share"] for h in heads])}  # fmt: skip


def markdown(result: dict) -> str:
    """One model's map: the predicted gains, then KL per variant."""
    s = summary(result)
    lines = [f"**{result['model']}** ({result['layers']} layers × {result['kv_heads']} kv heads of "
             f"{result['head_dim']}; "
             f"calibrated on {result['calibration']['text']} ({result['calibration']['windows']} × {result['ctx']}), "
             f"measured on {result['windows']} × {result['ctx']} tokens of {result['measured_on']}):", "",
             f"Predicted gain of a per-head basis: ½·log₂(AM/GM) median {s['am_gm_bits']['median']:.2f}, mean "
             f"{s['am_gm_bits']['mean']:.2f}, max {s['am_gm_bits']['max']:.2f} bits; water-filled at 3.5 bits median "
             f"{s['gain_bits_3.5']['median']:.2f}, max {s['gain_bits_3.5']['max']:.2f}. The head's mean carries a "
             f"median {s['mean_share']['median']:.0%} (max {s['mean_share']['max']:.0%}) of its values' energy.", "",
             "| values coded as | bits a value | with the tables fitted per sequence: at the window's "
             f"{result['ctx'] - SINKS:,} tokens / {' / '.join(f'{t // 1024}K' for t in TABLE_AT)} | KL | values' "
             "relative squared error | attention output's (after o_proj) |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in result["variants"]:
        share = f" (blocks: {row['fallback_share']:.0%} of token-heads)" if "fallback_share" in row else ""
        table = sequence_table(row, result["head_dim"])
        spread = " / ".join(f"{with_tables(row['bits'], table, result['head_dim'], t):.2f}"
                            for t in (result["ctx"] - SINKS, *TABLE_AT)) if table else "–"  # fmt: skip
        lines.append(f"| {row['variant']}{share} | {row['bits']:.3f} | {spread} | {row['kl']:.5f} | "
                     f"{row['value_mse']:.4f} | {row['output_mse']:.4f} |")  # fmt: skip
    return "\n".join(lines)


def sequence_table(row: dict, dim: int) -> int:
    """A measured variant's per-sequence table bytes per kv head, from its label (`(self)`, `(prefix)`: the whole
    tables; `(spreads: ...)`: the spreads' part; `table=int8`: the matrix in 8 bits)."""
    label = row["variant"]
    fitted = "spreads" if "(spreads" in label else "sequence" if "(self)" in label or "(prefix)" in label else "model"
    return table_bytes("basis" if "basis" in label else label, dim, fitted, "int8" if "int8" in label else "fp16")


def with_tables(bits: float, table: int, dim: int, tokens: int) -> float:
    """Bits a value once a head's per-sequence tables (`table` bytes) are spread over the `tokens` it codes."""
    return bits + 8 * table / (tokens * dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--calib", default="stdlib-code", help="the text the bases are calibrated on")
    parser.add_argument("--calib-windows", type=int, default=4)
    parser.add_argument("--only", default=None, help="measure only the coders whose label contains this")
    parser.add_argument("--out", default=str(RESULTS / "value_basis.json"))
    parser.add_argument("--append", action="store_true", help="keep the other models' results already in --out")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    results = []
    if args.append and Path(args.out).exists():  # (the same options: only the models measured now are replaced)
        earlier = json.loads(Path(args.out).read_text())
        given = {k: v for k, v in vars(args).items() if k not in ("models", "append")}
        kept = {k: earlier["config"].get(k) for k in given}
        if kept != given or earlier["config"].get("sinks") != SINKS:
            raise SystemExit(f"--append: {args.out} was measured with other options: {kept}")
        results = [r for r in earlier["results"] if r["model"] not in args.models.split(",")]
    for name in args.models.split(","):
        results.append(measure(name, args.ctx, args.windows, args.calib, args.calib_windows, args.only))
        results[-1]["summary"] = summary(results[-1])
        print(markdown(results[-1]) + "\n", flush=True)
        config = {**vars(args), "models": ",".join(r["model"] for r in results), "sinks": SINKS, "rates": RATES,
                  "date": time.strftime("%F"), "machine": machine()}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"config": config, "results": results}, f, indent=1)
            f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
