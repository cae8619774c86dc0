"""A whole window through the residual cache at once, differentiably: what training optimises.

It reproduces what `ResidualLayer` returns after one update of `T` tokens into an empty cache (sinks and the last
`window` tokens raw, references in their block format, every other token through the quantized latent), but with
straight-through gradients to the encoder and decoder. Tests hold the two to the same numbers.
"""

from __future__ import annotations

import torch

from .codec import fake_code_residuals
from .compressor import LayerCompressor, ResidualLayout
from .references import load_references, split_tokens
from .tokens import heads_to_tokens, tokens_to_heads


def code_window(
    compressor: LayerCompressor, bits: list[int], layout: ResidualLayout, keys: torch.Tensor, values: torch.Tensor
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
    out = x
    error = x.new_zeros(())
    if compressed:
        stream = x[:, begin : begin + compressed]
        split = split_tokens(stream, 0, layout)
        coded = stream.clone()
        if split.stored is not None:
            coded.index_copy_(1, split.reference_at, load_references(split.stored).to(coded.dtype))
        if split.coded_at.numel():
            target = stream.index_select(1, split.coded_at)
            dim = compressor.stream_dim
            residual = target - split.bases
            rk, rv = fake_code_residuals(compressor, bits, residual[..., :dim], residual[..., dim:])
            rebuilt = torch.cat([rk, rv], dim=-1) + split.bases
            coded.index_copy_(1, split.coded_at, rebuilt)
            centered = target - target.mean(dim=1, keepdim=True)
            error = (rebuilt - target).pow(2).sum() / centered.pow(2).sum().clamp_min(1e-12)
        out = torch.cat([x[:, :begin], coded, x[:, begin + compressed :]], dim=1)
    dim = x.shape[-1] // 2
    return tokens_to_heads(out[..., :dim], heads), tokens_to_heads(out[..., dim:], heads), error
