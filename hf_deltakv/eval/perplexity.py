"""Perplexity of a model over windows of a text, with every window read through a cache.

Each window is one forward pass with a fresh cache. The cache's `update` returns the reconstruction of all
tokens, the window's own included, so attention sees only what the cache stores (llama.cpp's perplexity tool
measures its quantized caches the same way).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache


@dataclass
class PerplexityResult:
    """Perplexity with the measured cache cost, averaged over windows."""

    perplexity: float
    tokens: int
    windows: int
    ctx: int
    bits_per_element: float
    nbytes: int
    seconds: float
    extra: dict = field(default_factory=dict)


def token_windows(ids: torch.Tensor, ctx: int, windows: int) -> list[torch.Tensor]:
    """First `windows` consecutive non-overlapping windows of `ctx` tokens from 1-D `ids`."""
    if ctx < 2:
        raise ValueError(f"ctx must be >= 2, got {ctx}")
    available = ids.numel() // ctx
    if available < windows:
        raise ValueError(f"text has {ids.numel()} tokens: {available} windows of {ctx}, {windows} asked")
    return [ids[i * ctx : (i + 1) * ctx] for i in range(windows)]


def cache_bits(cache: Cache) -> tuple[float, int]:
    """(bits per cached scalar, bytes held) of any cache, a plain DynamicCache included."""
    if hasattr(cache, "bits_per_element"):
        return cache.bits_per_element(), cache.nbytes()
    # DynamicCache: count what it really holds.
    nbytes = elements = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                nbytes += t.numel() * t.element_size()
                elements += t.numel()
    return (8 * nbytes / elements if elements else 0.0), nbytes


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    windows: list[torch.Tensor],
    make_cache: Callable[[], Cache] | None = None,
    progress: Callable[[int], None] | None = None,
) -> PerplexityResult:
    """Perplexity over `windows` (1-D token tensors), each scored in one forward through a fresh cache.

    Args:
        model: a causal LM.
        windows: token windows of equal length.
        make_cache: builds the cache for one window (default: `DynamicCache`, i.e. the uncompressed reference).
        progress: called with the number of windows done.
    """
    make_cache = make_cache or (lambda: DynamicCache())
    device = next(model.parameters()).device
    nll, count, bits, nbytes = 0.0, 0, [], []
    start = time.perf_counter()
    for i, window in enumerate(windows):
        ids = window.unsqueeze(0).to(device)
        cache = make_cache()
        logits = model(ids, cache=cache, use_cache=True).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
        b, n = cache_bits(cache)
        bits.append(b)
        nbytes.append(n)
        if progress:
            progress(i + 1)
    return PerplexityResult(
        perplexity=math.exp(nll / count),
        tokens=count,
        windows=len(windows),
        ctx=windows[0].numel(),
        bits_per_element=sum(bits) / len(bits),
        nbytes=int(sum(nbytes) / len(nbytes)),
        seconds=time.perf_counter() - start,
    )
