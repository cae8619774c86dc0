"""Python side of the CPU stream-attention kernel (`stream_attention.cpp`). Specification:
`reference.stream_attention`."""

from __future__ import annotations

import math

import torch

from ...codecs.layout import EMPTY_BYTES, StreamLayout

EMPTY_FLOAT = torch.empty(0)
TOKENS_PER_ITEM = 256  # tokens per work item: items are spread over the threads, then merged


def _channel_major(table: torch.Tensor) -> torch.Tensor:
    """`[batch, tokens, dim]` as the kernel reads it: a contiguous `[batch, dim, tokens]` (no copy when it is one)."""
    return table.transpose(1, 2).contiguous()


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: StreamLayout,
    values: StreamLayout,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
    length: int,
    extension,
) -> torch.Tensor:
    """Run the compiled kernel; arguments as in `reference.stream_attention`, the streams given by their layouts."""
    aligned = math.lcm(keys.meta[6] if keys.meta[0] == 1 else 1, values.meta[6] if values.meta[0] == 1 else 1)
    split = -(-TOKENS_PER_ITEM // aligned) * aligned  # delta streams: every work item starts on a keyframe
    return extension.stream_attention(
        query.float().contiguous(),
        sink_keys.float().contiguous(),
        sink_values.float().contiguous(),
        keys.tensors,
        keys.meta,
        values.tensors,
        values.meta,
        _channel_major(cos) if cos is not None else EMPTY_FLOAT,
        _channel_major(sin) if sin is not None else EMPTY_FLOAT,
        mask.to(torch.uint8).contiguous() if mask is not None else EMPTY_BYTES,
        n_queries,
        causal_offset,
        float(scale),
        length,
        split,
    )
