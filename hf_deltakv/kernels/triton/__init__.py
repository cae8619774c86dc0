"""Triton kernels, one op per file; each computes what the function of the same name in `kernels/reference.py`
specifies. Importing a file here needs Triton (an optional extra); `kernels.use_triton` decides when to."""

from __future__ import annotations

import torch

from ..layout import AdaptiveStream, ChannelStream, DeltaStream, PlainStream, RopeAngles, StreamLayout
from ..online_softmax import OnlineSoftmax


def KERNEL_MODULES() -> tuple:
    """Every module of Triton kernels (the ahead-of-time compile walks them)."""
    from . import (
        adaptive_attention,
        adaptive_code,
        append,
        copy,
        decode_attention,
        delta_attention,
        delta_encode,
        kept,
        latent,
        quantize,
        reconstruct,
        residual,
        sparse_matvec,
    )

    return (adaptive_attention, adaptive_code, append, copy, decode_attention, delta_attention, delta_encode, kept,
            latent, quantize, reconstruct, residual, sparse_matvec)  # fmt: skip


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: StreamLayout,
    values: StreamLayout,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
) -> torch.Tensor | None:
    """`reference.stream_attention` through the Triton kernel that reads these streams (the adaptive, plain and
    KIVI-style streams' kernels take up to `common.MAX_QUERIES` queries per head and merge the sink tokens themselves;
    the delta streams' kernel one query, its sinks merged by the reference's online softmax); None when no kernel reads
    them."""
    if not isinstance(values, PlainStream):
        return None
    if isinstance(keys, AdaptiveStream):
        from .adaptive_attention import adaptive_attention, supports

        if not supports(keys, values, mask, n_queries):
            return None
        return adaptive_attention(query, sink_keys, sink_values, keys, values, rope, mask, scale, n_queries,
                                  causal_offset)  # fmt: skip
    if isinstance(keys, (PlainStream, ChannelStream)):
        from .decode_attention import plain_attention, supports

        if not supports(keys, values, mask, n_queries):
            return None
        return plain_attention(query, sink_keys, sink_values, keys, values, rope, mask, scale, None, n_queries,
                               causal_offset)  # fmt: skip
    if n_queries != 1 or not isinstance(keys, DeltaStream):
        return None
    query = query.flatten(2, 3) if query.dim() == 5 else query
    from .delta_attention import delta_attention, supports

    if not supports(keys, values):
        return None
    cos = sin = None
    if rope is not None:  # full-width tables of this call only (the kernel reads rows of `dim`), on the device
        cos, sin = rope.cos_sin()
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    batch, heads, group, dim = query.shape
    sinks = sink_keys.shape[2]
    state = OnlineSoftmax(query.reshape(batch, heads * group, 1, dim), scale, None if mask is None else mask[:, None],
                          causal_offset + 1)  # fmt: skip
    if sinks:
        state.add(sink_keys, sink_values)
    acc, maximum, total = delta_attention(query, keys, values, cos, sin, None if mask is None else mask[:, 0], sinks,
                                          scale)  # fmt: skip
    state.merge(acc[:, :, :, None], maximum[..., None], total[..., None])
    return state.result().reshape(batch, heads, group, dim)
