"""Attention over the residual cache's coded tokens with the values attended in latent space.

The decoder is linear: a coded token's value is `z_t D + m` (`z_t` its dequantized value latent, `D` the decoder rows
of the latent groups kept, `m` the mean), so for a query of kv head `h`, `sum_t p_t v_t = (sum_t p_t z_t) D_h +
m_h sum_t p_t`: the softmax weights meet the packed latents, and the decoder is applied once per query instead of
once per cached token. Keys cannot take the same route when they are coded before RoPE (the rotation depends on the
position and does not commute with the decoder), so they are decoded a chunk at a time (only the kept groups: one
matrix product), RoPE re-applied, and scored; each chunk's softmax statistics are merged into the attention over the
raw sinks and window (`OnlineSoftmax.merge`). Transient memory is one chunk, whatever the context.

Specification: the layer's `reconstruct()` followed by SDPA (tested within fp32 rounding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import ops
from ..formats.bitpack import GROUP
from ..ops.online_softmax import OnlineSoftmax
from .compressor import LayerCompressor

CHUNK_TOKENS = 4096  # coded tokens decoded at a time: one chunk up to 4K tokens (fewer small ops; ~6 MB transient)


@functools.cache
def _kept(bits: tuple[int, ...]) -> tuple[list[int], torch.Tensor, int]:
    """Depths of the groups stored, the latent rows they fill, and their packed bytes (once per allocation: a layer
    asks at every decode step)."""
    rows = [g * GROUP + j for g, b in enumerate(bits) if b for j in range(GROUP)]
    return [b for b in bits if b], torch.tensor(rows, dtype=torch.long), sum(GROUP * b // 8 for b in bits)


def attend_coded(
    state: OnlineSoftmax,
    compressor: LayerCompressor,
    bits: list[int],
    codes: torch.Tensor,
    scales: torch.Tensor,
    first: int,
    kv_heads: int,
    rope_tables: Callable[[int, int], tuple[torch.Tensor | None, torch.Tensor | None]],
) -> None:
    """Fold coded tokens into `state`.

    Args:
        state: the attention being computed (queries, scale, mask over every position held).
        compressor, bits: the layer's decoder and its latent groups' depths (keys' groups, then values').
        codes, scales: `uint8 [batch, tokens, bytes]`, `fp16 [batch, tokens, kept groups]` of tokens coded against
            zero (no references).
        first: the position of the first coded token in `state`'s key order.
        kv_heads: heads per token.
        rope_tables: `rope_tables(begin, end)`: channel-major cos and sin `[batch, dim | dim / 2, end - begin]` of
            coded tokens `begin:end` (see `ops.latent_attention`), or None, None without RoPE.
    """
    half = len(bits) // 2
    key_bits, key_rows, key_bytes = _kept(tuple(bits[:half]))
    value_bits, value_rows, _ = _kept(tuple(bits[half:]))
    key_scales = len(key_bits)
    device = codes.device
    key_decoder = compressor.key_decoder.detach()[key_rows.to(device)]  # [kept, heads * dim]
    key_mean = compressor.key_mean.detach()
    value_dim = compressor.stream_dim // kv_heads
    value_decoder = compressor.value_decoder.detach()[value_rows.to(device)].view(-1, kv_heads, value_dim)
    value_mean = compressor.value_mean.detach().view(kv_heads, value_dim)
    query = state.grouped(kv_heads)
    batch, _, group, n, dim = query.shape
    rows = query.reshape(batch, kv_heads, group * n, dim)
    total = codes.shape[1]
    for start in range(0, total, CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, total)
        latent = ops.dequantize_latent(codes[:, start:end, :key_bytes], scales[:, start:end, :key_scales], key_bits)
        keys = torch.addmm(key_mean, latent.flatten(0, 1), key_decoder).view(batch, end - start, -1)
        allowed = state.allowed(first + start, first + end, kv_heads, device)
        if allowed is not None:
            allowed = allowed.expand(batch, kv_heads, group, n, end - start).reshape(batch, kv_heads, group * n, -1)
        cos, sin = rope_tables(start, end)
        value_codes, value_scales = codes[:, start:end, key_bytes:], scales[:, start:end, key_scales:]
        maximum, weight, latent_acc = ops.latent_attention(
            rows, keys, cos, sin, allowed, value_codes, value_scales, value_bits, state.scale
        )
        acc = torch.einsum("bhrl,lhd->bhrd", latent_acc, value_decoder) + weight[..., None] * value_mean[:, None]
        shape = (batch, kv_heads, group, n)
        state.merge(acc.view(*shape, value_dim), maximum.view(shape), weight.view(shape))
