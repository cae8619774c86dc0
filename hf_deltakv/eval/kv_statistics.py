"""What the codec sees: per-layer statistics of a model's pre-RoPE keys and values on a text.

Used by `benchmarks/key_statistics.py` and the codec notebook: how much of a vector a previous-token delta or the
running mean leaves to code, and how correlated neighbouring tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..cache import rope_forms
from ..kernels.hadamard import rotate


@dataclass(frozen=True)
class StreamStats:
    """RMS of the vectors, around their per-channel mean, of the previous-token delta; mean lag-1 autocorrelation."""

    rms: float
    rms_around_mean: float
    rms_of_delta: float
    lag1_autocorrelation: float


def stream_stats(x: torch.Tensor) -> StreamStats:
    """Statistics of `x` [batch, heads, tokens, head_dim] along its tokens."""
    centered = x - x.mean(dim=2, keepdim=True)
    delta = x[:, :, 1:] - x[:, :, :-1]
    lag1 = (centered[:, :, 1:] * centered[:, :, :-1]).sum(2) / centered[:, :, :-1].pow(2).sum(2).clamp_min(1e-12)
    return StreamStats(_rms(x), _rms(centered), _rms(delta), lag1.mean().item())


def _rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


@torch.no_grad()
def kv_streams(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (pre-RoPE keys, values) of `ids` [1, tokens], in fp32: what the codec is handed."""
    cache = DynamicCache()
    model(ids, cache=cache, use_cache=True)
    forms = rope_forms(model) or [None] * len(cache.layers)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    streams = []
    for layer, form in zip(cache.layers, forms, strict=True):
        keys = layer.keys.float() if form is None else form.undo(layer.keys, positions)
        streams.append((keys, layer.values.float()))
    return streams


def layer_statistics(model: torch.nn.Module, ids: torch.Tensor, sinks: int = 4) -> list[dict[str, StreamStats]]:
    """Per layer, `{"keys": ..., "values": ...}` statistics after the codec's Hadamard rotation, leaving out the
    first `sinks` tokens (the cache keeps them raw)."""
    return [
        {"keys": stream_stats(rotate(k[:, :, sinks:])), "values": stream_stats(rotate(v[:, :, sinks:]))}
        for k, v in kv_streams(model, ids)
    ]
