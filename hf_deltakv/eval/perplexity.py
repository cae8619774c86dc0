"""Perplexity of a model over windows of a text, with every window read through a cache.

Two protocols. `one-forward`: each window is one forward pass with a fresh cache. Our caches' `update` returns the
reconstruction of all tokens, the window's own included, so attention sees only what the cache stores
(llama.cpp's perplexity tool measures its quantized caches the same way). transformers' `QuantizedCache` instead
returns the unquantized prefill and keeps a full-precision window of recent tokens, so one forward shows no loss
for it at all. `chunked`: a prefix, then teacher-forced chunks down to one token at a time, so that the scored
tokens attend to the stored history whatever the cache does with the tokens of the current step.

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

from ..quant import nbytes_of


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
    protocol: str = "one-forward"


def token_windows(ids: torch.Tensor, ctx: int, windows: int) -> list[torch.Tensor]:
    """First `windows` consecutive non-overlapping windows of `ctx` tokens from 1-D `ids`."""
    if ctx < 2:
        raise ValueError(f"ctx must be >= 2, got {ctx}")
    available = ids.numel() // ctx
    if available < windows:
        raise ValueError(f"text has {ids.numel()} tokens: {available} windows of {ctx}, {windows} asked")
    return [ids[i * ctx : (i + 1) * ctx] for i in range(windows)]


def kv_elements(config, tokens: int, batch: int = 1) -> int:
    """Scalars a full-precision cache of `tokens` tokens would hold (keys and values, every layer)."""
    config = config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * tokens * batch


def cache_bits(cache: Cache, elements: int | None = None) -> tuple[float, int]:
    """(bits per cached scalar, bytes held) of any cache.

    Our caches count their own bytes. For other caches (DynamicCache, transformers' QuantizedCache with its quanto
    or HQQ backend) every tensor a layer holds is counted: quantized codes, scales, zero points and the
    full-precision window of recent tokens. `elements` (see `kv_elements`) is the number of cached scalars; without
    it, it is read off the full-precision tensors, which is only right for an unquantized cache.
    """
    if hasattr(cache, "bits_per_element"):
        return cache.bits_per_element(), cache.nbytes()
    nbytes = nbytes_of([vars(layer) for layer in cache.layers])
    if elements is None:
        elements = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    return (8 * nbytes / elements if elements else 0.0), nbytes


PROTOCOLS = ("one-forward", "chunked")
CHUNK = 16  # tokens per teacher-forced step of the chunked protocol


def _window_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, cache: Cache, protocol: str, prefix: int, chunk: int, on_chunk=None
) -> torch.Tensor:
    """Next-token log-probabilities `[scored, vocab]` of one window `[1, ctx]` read through `cache`.

    one-forward: the whole window in one pass; all `ctx - 1` predictions are scored.
    chunked: the first `prefix` tokens are prefilled, then the rest is fed teacher-forced `chunk` tokens at a time,
    so every scored token attends to the history as the cache stores it (what decoding sees). The `ctx - prefix`
    predictions of the tokens after the prefix are scored.
    """
    if protocol == "one-forward":
        return torch.log_softmax(model(ids, cache=cache, use_cache=True).logits[0, :-1].float(), dim=-1)
    if protocol != "chunked":
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    ctx = ids.shape[1]
    if not 0 < prefix < ctx or chunk < 1:
        raise ValueError(f"chunked protocol needs 0 < prefix < ctx and chunk >= 1, got prefix={prefix}, chunk={chunk}")
    logits = [model(ids[:, :prefix], cache=cache, use_cache=True).logits[0, -1:].float()]
    for start in range(prefix, ctx - 1, chunk):
        logits.append(model(ids[:, start : min(start + chunk, ctx - 1)], cache=cache, use_cache=True).logits[0].float())
        if on_chunk:
            on_chunk()
    return torch.log_softmax(torch.cat(logits), dim=-1)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    windows: list[torch.Tensor],
    make_cache: Callable[[], Cache] | None = None,
    progress: Callable[[int], None] | None = None,
    reference: list[torch.Tensor] | None = None,
    keep_logprobs: bool = False,
    protocol: str = PROTOCOLS[0],
    prefix: int | None = None,
    chunk: int = CHUNK,
) -> PerplexityResult:
    """Perplexity over `windows` (1-D token tensors), each read through a fresh cache.

    Args:
        model: a causal LM.
        windows: token windows of equal length.
        make_cache: builds the cache for one window (default: `DynamicCache`, i.e. the uncompressed reference).
        progress: called with the number of windows done.
        reference: log-probabilities of a reference run under the same protocol, for KL divergence.
        keep_logprobs: return this run's log-probabilities to serve as a reference.
        protocol: `one-forward` (each window in one pass) or `chunked` (prefix, then teacher-forced chunks).
        prefix: tokens prefilled before the chunks (default: half the window).
        chunk: tokens per teacher-forced step in the chunked protocol (1 = token by token, like decoding).

    Bits/element: at the end of each window; in the chunked protocol, the mean over the chunk steps, so that a
    full-precision window of recent tokens (transformers' QuantizedCache) is counted at its average size.
    """
    make_cache = make_cache or DynamicCache
    device = next(model.parameters()).device
    ctx = windows[0].numel()
    prefix = ctx // 2 if prefix is None else prefix
    nll = kl = agree = 0.0
    count, bits, nbytes, kept = 0, [], [], []
    start = time.perf_counter()
    for i, window in enumerate(windows):
        ids = window.unsqueeze(0).to(device)
        cache = make_cache()
        step_bits: list[tuple[float, int]] = []

        def measure(cache=cache, step_bits=step_bits):
            step_bits.append(cache_bits(cache, kv_elements(model.config, cache.get_seq_length())))

        logprobs = _window_logprobs(model, ids, cache, protocol, prefix, chunk, measure)
        targets = ids[0, ids.shape[1] - logprobs.shape[0] :]
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        if reference is not None:
            ref = reference[i].to(logprobs.device).float()
            kl += (ref.exp() * (ref - logprobs)).sum().item()
            agree += (ref.argmax(-1) == logprobs.argmax(-1)).sum().item()
        if keep_logprobs:
            kept.append(logprobs.cpu())
        count += logprobs.shape[0]
        if not step_bits:
            measure()
        bits.append(sum(b for b, _ in step_bits) / len(step_bits))
        nbytes.append(step_bits[-1][1])
        if progress:
            progress(i + 1)
    return PerplexityResult(
        perplexity=math.exp(nll / count),
        tokens=count,
        windows=len(windows),
        ctx=ctx,
        bits_per_element=sum(bits) / len(bits),
        nbytes=int(sum(nbytes) / len(nbytes)),
        seconds=time.perf_counter() - start,
        kl_divergence=kl / count if reference is not None else None,
        top1_agreement=agree / count if reference is not None else None,
        logprobs=kept if keep_logprobs else None,
        protocol=protocol,
    )
