"""Triton kernels, one op per file; each computes what the function of the same name in `kernels/reference.py`
specifies. Importing a file here needs Triton (an optional extra); `kernels.use_triton` decides when to."""

from __future__ import annotations

import torch

from ..layout import AdaptiveStream, ChannelStream, DeltaStream, PlainStream, RopeAngles, StreamLayout


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
        step,
    )

    return (adaptive_attention, adaptive_code, append, copy, decode_attention, delta_attention, delta_encode, kept,
            latent, quantize, reconstruct, residual, sparse_matvec, step)  # fmt: skip


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: StreamLayout,
    values: StreamLayout,
    *,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
) -> torch.Tensor | None:
    """`reference.stream_attention` through the Triton kernel that reads these streams (adaptive, plain, KIVI-style or
    token-delta keys: up to `common.MAX_QUERIES` queries per head, the sink tokens merged by the kernels); None when
    no kernel reads them."""
    options = dict(rope=rope, mask=mask, n_queries=n_queries, causal_offset=causal_offset, scale=scale)
    if not isinstance(values, PlainStream):
        return None
    if isinstance(keys, AdaptiveStream):
        from .adaptive_attention import adaptive_attention, supports

        if not supports(keys, values, mask, n_queries):
            return None
        return adaptive_attention(query, sink_keys, sink_values, keys, values, **options)
    if isinstance(keys, (PlainStream, ChannelStream)):
        from .decode_attention import plain_attention, supports

        if not supports(keys, values, mask, n_queries):
            return None
        return plain_attention(query, sink_keys, sink_values, keys, values, **options)
    if not isinstance(keys, DeltaStream):
        return None
    from .delta_attention import delta_attention, supports

    if not supports(keys, values, mask, n_queries):
        return None
    return delta_attention(query, sink_keys, sink_values, keys, values, **options)
