"""Initialise a compressor from calibration text: PCA of the residuals and a measured bit allocation.

Per layer and stream, the encoder starts as the principal axes of the residuals (token minus the mean of its
nearest references), so latent components come ordered by variance. Each group of 32 components then gets the bit
depth that buys the most reduction of measured relative error per stored bit (greedy over both streams, scales
included), until the layer's budget of `rate` bits per cached scalar is spent. High-variance groups get 6-8 bits,
the tail few or none: with a fixed-rate quantizer, a transform only pays when bits follow the variance.
Training (`train.py`) then refines encoder and decoder for the model's loss with this allocation fixed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..eval.kv_statistics import kv_streams
from ..eval.perplexity import perplexity
from ..quant.bitpack import BIT_DEPTHS, GROUP, fake_quantize_group
from .checkpoint import model_signature
from .compressor import ResidualCompressor, ResidualConfig, ResidualLayout
from .references import split_tokens
from .tokens import heads_to_tokens

LADDER = (0, *BIT_DEPTHS)
# Windows the per-layer sensitivity is measured on: each costs one forward per layer, the bulk of a fit's time.
SENSITIVITY_WINDOWS = 2


def layer_residuals(
    keys: torch.Tensor, values: torch.Tensor, layout: ResidualLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residuals `[n, 2 * dim]` of the tokens the cache would code, those tokens centered) of one window."""
    x = torch.cat([heads_to_tokens(keys), heads_to_tokens(values)], dim=-1)[:, layout.sink_tokens :]
    split = split_tokens(x, 0, layout)
    target = x.index_select(1, split.coded_at)
    residual = target - split.bases
    return residual.reshape(-1, x.shape[-1]), (target - target.mean(1, keepdim=True)).reshape(-1, x.shape[-1])


def principal_axes(residual: torch.Tensor, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, orthonormal axes `[dim, latent_dim]` by decreasing variance, zero-padded)."""
    mean = residual.mean(0)
    centered = residual - mean
    _, vectors = torch.linalg.eigh(centered.T @ centered / len(centered))
    axes = torch.zeros(residual.shape[1], latent_dim)
    axes[:, : residual.shape[1]] = vectors.flip(1)
    return mean, axes


def group_distortion(latent: torch.Tensor, energy: float) -> torch.Tensor:
    """Relative squared error `[groups, len(LADDER)]` of each latent group at each bit depth."""
    groups = latent.reshape(len(latent), -1, GROUP)
    table = torch.empty(groups.shape[1], len(LADDER))
    for j, bits in enumerate(LADDER):
        coded = torch.zeros_like(groups) if bits == 0 else fake_quantize_group(groups, bits)
        table[:, j] = (coded - groups).pow(2).sum((0, 2)) / energy
    return table


def allocate_bits(distortion: torch.Tensor, budget_bits: float, start: list[int] | None = None) -> list[int]:
    """Greedy bit depths (from LADDER) per group `[groups, len(LADDER)]`: repeatedly take the upgrade with the best
    error reduction per stored bit until the budget (which includes the `start` depths) is spent."""
    cost = torch.tensor([0.0] + [GROUP * b + 16.0 for b in BIT_DEPTHS])
    level = torch.tensor([LADDER.index(b) for b in start] if start else [0] * len(distortion))
    spent = cost[level].sum().item()
    columns = torch.arange(len(LADDER))
    while True:
        current_cost = cost[level].unsqueeze(1)
        extra = cost.unsqueeze(0) - current_cost
        gain = (distortion.gather(1, level.unsqueeze(1)) - distortion) / extra.clamp_min(1e-9)
        allowed = (columns.unsqueeze(0) > level.unsqueeze(1)) & (extra <= budget_bits - spent)
        gain = gain.masked_fill(~allowed, float("-inf"))
        best = int(gain.argmax())
        g, nxt = divmod(best, len(LADDER))
        if not torch.isfinite(gain[g, nxt]) or gain[g, nxt] <= 0:
            return [LADDER[j] for j in level.tolist()]
        spent += extra[g, nxt].item()
        level[g] = nxt


def layer_sensitivity(
    model: nn.Module, compressor: ResidualCompressor, windows: list[torch.Tensor], distortion: list[float]
) -> list[float]:
    """KL divergence per unit of relative error of each layer: the KL measured when only that layer is coded,
    divided by that layer's predicted error (`distortion`)."""
    from .cache import ResidualKVCache  # the cache is built from what this module fits

    flat = [w[0] for w in windows]
    reference = perplexity(model, flat, keep_logprobs=True).logprobs
    layers = range(compressor.config.num_layers)
    slopes = []
    for layer in layers:
        others = tuple(i for i in layers if i != layer)
        kl = perplexity(
            model,
            flat,
            lambda others=others: ResidualKVCache(model, compressor, uncompressed_layers=others),
            reference=reference,
        ).kl_divergence
        slopes.append(max(kl, 1e-9) / max(distortion[layer], 1e-12))
    return slopes


@torch.no_grad()
def fit_compressor(
    model: nn.Module,
    windows: list[torch.Tensor],
    rate: float,
    layout: ResidualLayout,
    key_weight: float = 1.0,
    sensitivity_windows: int = SENSITIVITY_WINDOWS,
    training: dict | None = None,
) -> ResidualCompressor:
    """A compressor for `model` initialised on calibration `windows` (token ids `[1, T]` each).

    Bits are first spread evenly over layers (`rate` each); then, with `sensitivity_windows` > 0, the KL divergence
    each layer causes alone is measured on that many windows, and the budget is re-allocated over all layers'
    groups weighting each layer's error by its measured sensitivity (every layer keeps at least half the rate).

    Args:
        rate: bits per cached scalar spent on a coded token's latent codes and scales (mean over layers).
        layout: references, sinks and window the cache will use.
        key_weight: weight of the keys' relative error against the values' in the bit allocation.
        sensitivity_windows: windows used to measure per-layer sensitivity (0: even allocation).
    """
    signature = model_signature(model)
    dim = signature["kv_heads"] * signature["head_dim"]
    latent_dim = -(-dim // GROUP) * GROUP
    per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(signature["num_layers"])]
    for ids in windows:
        for layer, (keys, values) in enumerate(kv_streams(model, ids)):
            per_layer[layer].append(layer_residuals(keys, values, layout))
    states, tables_per_layer = [], []
    for parts in per_layer:
        residual = torch.cat([p[0] for p in parts])
        centered = torch.cat([p[1] for p in parts])
        state, tables = {}, []
        for name, cols in (("key", slice(0, dim)), ("value", slice(dim, 2 * dim))):
            mean, axes = principal_axes(residual[:, cols], latent_dim)
            state[f"{name}_mean"], state[f"{name}_encoder"], state[f"{name}_decoder"] = mean, axes, axes.T
            energy = centered[:, cols].pow(2).sum().item()
            weight = key_weight if name == "key" else 1.0
            tables.append(weight * group_distortion((residual[:, cols] - mean) @ axes, energy))
        states.append(state)
        tables_per_layer.append(torch.cat(tables))
    bits = [allocate_bits(table, rate * 2 * dim) for table in tables_per_layer]
    compressor = _build(signature, latent_dim, bits, layout, states, {"rate": rate, "key_weight": key_weight})
    if sensitivity_windows:
        distortion = [_table_error(t, b) for t, b in zip(tables_per_layer, bits, strict=True)]
        slopes = layer_sensitivity(model, compressor, windows[:sensitivity_windows], distortion)
        floor = [allocate_bits(table, rate * dim) for table in tables_per_layer]
        weighted = torch.cat([s * t for s, t in zip(slopes, tables_per_layer, strict=True)])
        flat = allocate_bits(weighted, rate * 2 * dim * len(bits), [b for layer in floor for b in layer])
        groups = len(bits[0])
        bits = [flat[i * groups : (i + 1) * groups] for i in range(len(bits))]
        compressor = _build(
            signature,
            latent_dim,
            bits,
            layout,
            states,
            {"rate": rate, "key_weight": key_weight, "sensitivity": [round(s, 6) for s in slopes]},
        )
    compressor.config.training.update(training or {})
    return compressor


def _table_error(table: torch.Tensor, bits: list[int]) -> float:
    return sum(table[g, LADDER.index(b)].item() for g, b in enumerate(bits))


def _build(
    signature: dict, latent_dim: int, bits, layout: ResidualLayout, states, training: dict
) -> ResidualCompressor:
    config = ResidualConfig(
        num_layers=signature["num_layers"],
        kv_heads=signature["kv_heads"],
        head_dim=signature["head_dim"],
        latent_dim=latent_dim,
        bits=bits,
        layout=layout,
        model=signature,
        training=training,
    )
    compressor = ResidualCompressor(config)
    for layer, state in zip(compressor.layers, states, strict=True):
        layer.load_state_dict(state)
    return compressor.requires_grad_(False)
