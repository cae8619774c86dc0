"""PyTorch reference implementations: the specification of every op a kernel may replace.

Each function here is what a Triton kernel of the same name must compute (tests compare the two on odd shapes).
"""

from __future__ import annotations

import torch

from ..attention.chunked import CHUNK_TOKENS
from ..quant import QuantizedTensor, dequantize, quantize

__all__ = [
    "code_delta",
    "decode_attention",
    "delta_encode_groups",
    "dequantize",
    "dequantize_latent",
    "quantize",
    "segmented_prefix_sum",
    "skip_matvec",
    "stream_attention",
]


def code_delta(
    x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor, fmt: str, intra: bool
) -> tuple[QuantizedTensor, torch.Tensor]:
    """One closed-loop step of the delta codec: `x - base` quantized in `fmt`, and with `intra` per block the better
    (smaller squared error, summed in fp64) of that and `x - long_term`, flagged in the scale's lowest bit. Returns
    the stored blocks and the reconstruction the decoder computes from them. (Defined in `codecs.delta`.)"""
    from ..codecs.delta import code_delta as spec

    return spec(x, base, long_term, fmt, intra)


def segmented_prefix_sum(values: torch.Tensor, resets: torch.Tensor, dim: int) -> torch.Tensor:
    """Running sum of `values` along `dim` that restarts wherever `resets` is True.

    Args:
        values: fp32 tensor.
        resets: bool tensor broadcastable to `values`; position 0 along `dim` is always a restart.

    Returns:
        `out[i] = values[r] + ... + values[i]` with `r` the last restart at or before `i`.
    """
    resets = resets.expand_as(values).clone()
    resets.narrow(dim, 0, 1).fill_(True)
    shape = [1] * values.dim()
    shape[dim] = values.shape[dim]
    offsets = torch.arange(values.shape[dim], device=values.device).view(shape)
    last_reset = torch.where(resets, offsets, torch.zeros_like(offsets)).cummax(dim=dim).values
    total = values.cumsum(dim=dim)
    return total - (total.gather(dim, last_reset) - values.gather(dim, last_reset))


def skip_matvec(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor, block_size: int
) -> torch.Tensor:
    """`x @ weight.T + bias` with the input blocks where `keep` [blocks] is False left out.

    Args:
        x: [batch, in] activations.
        weight: [out, in] (any strides).
        bias: [out] or None.
        keep: bool [ceil(in / block_size)]: which blocks of `block_size` input features to compute.
    """
    columns = keep.repeat_interleave(block_size)[: weight.shape[1]]
    out = x[:, columns].to(weight.dtype) @ weight[:, columns].T
    return out if bias is None else out + bias


def decode_attention(
    query: torch.Tensor,
    keys: QuantizedTensor,
    values: QuantizedTensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over a block-quantized cache (GQA-aware).

    Args:
        query: [batch, q_heads, head_dim].
        keys, values: packed `[batch, kv_heads, tokens, head_dim]` (q4_0, q4_1, q8_0 or their 16-wide variants);
            q_heads must be a multiple of kv_heads (query head h reads kv head h // (q_heads // kv_heads)).
        scale: softmax scale (usually head_dim ** -0.5).
        mask: optional bool [batch, tokens], True where a token may be attended to.

    Returns:
        [batch, q_heads, head_dim] in fp32.
    """
    k, v = dequantize(keys), dequantize(values)
    group = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", query.float(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v)


def dequantize_latent(packed: torch.Tensor, scales: torch.Tensor, bits: list[int]) -> torch.Tensor:
    """The residual cache's latent from its packed groups (the first step of residual reconstruction).

    Args:
        packed: `uint8 [..., code_bytes]`: group after group, each of `GROUP` codes packed at its bit depth.
        scales: `float16 [..., kept groups]`: one scale per group whose depth is not 0.
        bits: bit depth of every latent group (0 = dropped, decodes as zeros).

    Returns:
        fp32 `[..., len(bits) * GROUP]`.
    """
    from ..quant.bitpack import GROUP, dequantize_group, unpack_bits

    lead = packed.shape[:-1]
    latent = torch.zeros(*lead, len(bits), GROUP, device=packed.device)
    offset = kept = 0
    for g, b in enumerate(bits):
        if b:
            nbytes = GROUP * b // 8
            codes = unpack_bits(packed[..., offset : offset + nbytes], b)
            latent[..., g, :] = dequantize_group(codes, scales[..., kept], b)
            offset, kept = offset + nbytes, kept + 1
    return latent.reshape(*lead, len(bits) * GROUP)


def delta_encode_groups(
    x: torch.Tensor, long_term: torch.Tensor | None, keyframes: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-loop delta coding of whole keyframe groups (what `DeltaCodec` does on a prefill), q4_0 arithmetic.

    Args:
        x: fp32 `[streams, groups, kf, dim]`; offset 0 of each group is its keyframe (not coded here).
        long_term: fp32 like `x`: the intra reference of every token, or None for inter-only coding.
        keyframes: fp32 `[streams, groups, dim]`: the keyframes' reconstructions, where each group's loop starts.
        block: channels per block (16: `q4_0_16`, 32: `q4_0`).

    Returns:
        codes `uint8 [streams, groups, kf - 1, dim / block, block / 2]`, scales `float16 [..., dim / block]` (intra
        flag in the lowest mantissa bit) and the reconstruction of every token `[streams, groups, kf, dim]`.
    """
    from ..codecs.delta import code_delta

    fmt = {16: "q4_0_16", 32: "q4_0"}[block]
    recon = [keyframes.float()]
    streams, groups, kf, dim = x.shape
    codes = x.new_empty(streams, groups, kf - 1, dim // block, block // 2, dtype=torch.uint8)
    scales = x.new_empty(streams, groups, kf - 1, dim // block, dtype=torch.float16)
    for offset in range(1, kf):
        reference = long_term[:, :, offset] if long_term is not None else recon[-1]
        q, rec = code_delta(x[:, :, offset], recon[-1], reference, fmt, long_term is not None)
        codes[:, :, offset - 1], scales[:, :, offset - 1] = q.codes, q.scales
        recon.append(rec)
    return codes, scales, torch.stack(recon, dim=2)


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    key_codec,
    value_codec,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
    chunk: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """Attention over a cache layer's raw sink tokens followed by its codec-stored stream, read chunk by chunk.

    Args:
        query: fp32 `[batch, kv_heads, group * n_queries, dim]`; row `g * n_queries + i` is query `i` of the kv
            head's `g`-th query head.
        sink_keys, sink_values: `[batch, kv_heads, sinks, dim]` raw tokens (keys with RoPE); sinks may be 0.
        key_codec, value_codec: `StreamCodec`s holding the same number of tokens (keys before RoPE when `cos` is
            given).
        cos, sin: fp32 `[batch, stream tokens, dim]`: RoPE of every stored token, or None.
        mask: bool `[batch, n_queries, sinks + stream tokens]`, True where query `i` may attend; None: causal, token
            `u` (sinks counted) visible to query `i` when `u <= causal_offset + i`.
        scale: softmax scale.
        chunk: stream tokens reconstructed at a time (the bound on transient memory).

    Returns:
        fp32 `[batch, kv_heads, rows, value_dim]`; a row that may attend no token gets zeros.
    """
    from ..attention.chunked import OnlineSoftmax, codec_chunks

    batch, heads, rows, dim = query.shape
    grouped = query.reshape(batch, heads * (rows // n_queries), n_queries, dim)
    state = OnlineSoftmax(grouped, scale, mask[:, None] if mask is not None else None, causal_offset + n_queries)
    sinks = sink_keys.shape[2]
    if sinks:
        state.add(sink_keys, sink_values)
    for start, keys, values in codec_chunks(key_codec, value_codec, cos, sin, chunk):
        state.add(keys, values, sinks + start)
    out = state.result()
    return out.reshape(batch, heads, rows, out.shape[-1])
