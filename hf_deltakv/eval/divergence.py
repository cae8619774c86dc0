"""KL divergence of a cached model's next-token distributions from the uncompressed model's.

Perplexity differences of a fraction of a percent are noisy: a perturbation can help on one token and hurt on the
next. The mean KL divergence from the reference distribution (as llama.cpp's `--kl-divergence` reports) only
grows with distortion, so it ranks close variants reliably; tune on it, report perplexity too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .perplexity import cache_bits


@dataclass
class DivergenceResult:
    kl_divergence: float
    top1_agreement: float
    delta_ppl_pct: float
    bits_per_element: float


class ReferenceDistributions:
    """Log-probabilities of the uncompressed model on each window (kept in bf16 to bound memory)."""

    @torch.no_grad()
    def __init__(self, model: torch.nn.Module, windows: list[torch.Tensor]) -> None:
        self.model, self.windows = model, windows
        self.logprobs = [self._logprobs(w, None).to(torch.bfloat16) for w in windows]
        self.nll = sum(self._nll(lp.float(), w) for lp, w in zip(self.logprobs, windows, strict=True))

    def _logprobs(self, window: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        out = self.model(window.unsqueeze(0), cache=cache, use_cache=cache is not None)
        return torch.log_softmax(out.logits[0, :-1].float(), dim=-1)

    @staticmethod
    def _nll(logprobs: torch.Tensor, window: torch.Tensor) -> float:
        return -logprobs.gather(1, window[1:, None]).sum().item()

    @torch.no_grad()
    def compare(self, make_cache: Callable[[], Cache]) -> DivergenceResult:
        kl = agree = nll = 0.0
        bits = []
        for reference, window in zip(self.logprobs, self.windows, strict=True):
            cache = make_cache()
            logprobs = self._logprobs(window, cache)
            ref = reference.float()
            kl += (ref.exp() * (ref - logprobs)).sum().item()
            agree += (ref.argmax(-1) == logprobs.argmax(-1)).sum().item()
            nll += self._nll(logprobs, window)
            bits.append(cache_bits(cache)[0])
        count = sum(w.numel() - 1 for w in self.windows)
        return DivergenceResult(
            kl_divergence=kl / count,
            top1_agreement=agree / count,
            delta_ppl_pct=100 * (math.exp((nll - self.nll) / count) - 1),
            bits_per_element=sum(bits) / len(bits),
        )
