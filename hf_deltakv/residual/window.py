"""A whole window through the residual cache at once, differentiably: what training optimises.

It reproduces what `ResidualLayer` returns after one update of `T` tokens into an empty cache (sinks and the last
`window` tokens raw, references in their block format, every other token through the quantized latent), but with
straight-through gradients to the encoder and decoder. Tests hold the two to the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.residual import heads_to_tokens, tokens_to_heads
from .codec import fake_code_residuals
from .compressor import LayerCompressor
from .references import is_reference, load_references, store_references, token_bases


@dataclass(frozen=True)
class Layout:
    stride: int
    top_k: int
    sink_tokens: int
    window: int
    reference_format: str


def code_window(
    compressor: LayerCompressor, bits: list[int], layout: Layout, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reconstruct pre-RoPE `keys` and `values` `[batch, heads, T, dim]` as the cache would store them.

    Returns:
        keys, values (fp32, same shape) and the relative squared error of the coded tokens (a scalar tensor:
        error energy over the energy of those tokens around their mean; 0 when no token is coded).
    """
    heads, total = keys.shape[1], keys.shape[2]
    x = torch.cat([heads_to_tokens(keys.float()), heads_to_tokens(values.float())], dim=-1)
    begin = min(layout.sink_tokens, total)
    compressed = max(total - begin - layout.window, 0)
    out = x.clone()
    error = x.new_zeros(())
    if compressed:
        stream = x[:, begin : begin + compressed]
        index = torch.arange(compressed, device=x.device)
        is_ref = is_reference(index, layout.stride)
        coded = stream.clone()
        refs = None
        if is_ref.any():
            refs = load_references(store_references(stream[:, is_ref].detach(), layout.reference_format))
            coded[:, is_ref] = refs
        others = ~is_ref
        if others.any():
            target = stream[:, others]
            _, base = token_bases(target.detach(), index[others], refs, index[is_ref], layout.top_k)
            dim = compressor.stream_dim
            residual = target - base
            rk, rv = fake_code_residuals(compressor, bits, residual[..., :dim], residual[..., dim:])
            rebuilt = torch.cat([rk, rv], dim=-1) + base
            coded[:, others] = rebuilt
            centered = target - target.mean(dim=1, keepdim=True)
            error = (rebuilt - target).pow(2).sum() / centered.pow(2).sum().clamp_min(1e-12)
        out = torch.cat([x[:, :begin], coded, x[:, begin + compressed :]], dim=1)
    dim = x.shape[-1] // 2
    return tokens_to_heads(out[..., :dim], heads), tokens_to_heads(out[..., dim:], heads), error
