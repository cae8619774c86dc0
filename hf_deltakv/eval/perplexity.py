"""Perplexity of a model over windows of a text, with every window read through a cache.

Each window is one forward pass with a fresh cache. The cache's `update` returns the reconstruction of all
tokens, the window's own included, so attention sees only what the cache stores (llama.cpp's perplexity tool
measures its quantized caches the same way).

Given the reference model's log-probabilities, the same pass also measures the mean KL divergence from them and
top-1 agreement. Perplexity differences of a fraction of a percent are noisy (a perturbation helps one token and
hurts the next); KL divergence only grows with distortion, so it ranks close variants reliably.
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
    kl_divergence: float | None = None
    top1_agreement: float | None = None
    logprobs: list[torch.Tensor] | None = field(default=None, repr=False)


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
    reference: list[torch.Tensor] | None = None,
    keep_logprobs: bool = False,
) -> PerplexityResult:
    """Perplexity over `windows` (1-D token tensors), each scored in one forward through a fresh cache.

    Args:
        model: a causal LM.
        windows: token windows of equal length.
        make_cache: builds the cache for one window (default: `DynamicCache`, i.e. the uncompressed reference).
        progress: called with the number of windows done.
        reference: log-probabilities `[ctx - 1, vocab]` per window of a reference run, for KL divergence.
        keep_logprobs: return this run's log-probabilities (bf16) to serve as a reference.
    """
    make_cache = make_cache or DynamicCache
    device = next(model.parameters()).device
    nll = kl = agree = 0.0
    count, bits, nbytes, kept = 0, [], [], []
    start = time.perf_counter()
    for i, window in enumerate(windows):
        ids = window.unsqueeze(0).to(device)
        cache = make_cache()
        logprobs = torch.log_softmax(model(ids, cache=cache, use_cache=True).logits[0, :-1].float(), dim=-1)
        nll -= logprobs.gather(1, ids[0, 1:, None]).sum().item()
        if reference is not None:
            ref = reference[i].to(logprobs.device).float()
            kl += (ref.exp() * (ref - logprobs)).sum().item()
            agree += (ref.argmax(-1) == logprobs.argmax(-1)).sum().item()
        if keep_logprobs:
            kept.append(logprobs.to(torch.bfloat16).cpu())
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
        kl_divergence=kl / count if reference is not None else None,
        top1_agreement=agree / count if reference is not None else None,
        logprobs=kept if keep_logprobs else None,
    )
