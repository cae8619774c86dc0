"""Python side of the CPU stream-attention kernel (`stream_attention.cpp`). Specification:
`reference.stream_attention`."""

from __future__ import annotations

import math

import torch

from ...quant import QuantizedTensor
from ..hadamard import rotation_scale
from ..layout import AdaptiveStream, ChannelStream, DeltaStream, PlainStream, StreamLayout

EMPTY_FLOAT = torch.empty(0)
EMPTY_BYTES = torch.empty(0, dtype=torch.uint8)
EMPTY_LONG = torch.empty(0, dtype=torch.long)
EMPTY_DOUBLE = torch.empty(0, dtype=torch.float64)
EMPTY_BOOL = torch.empty(0, dtype=torch.bool)
EMPTY_HALF = torch.empty(0, dtype=torch.float16)
TOKENS_PER_ITEM = 256  # tokens per work item: items are spread over the threads, then merged
TILE = 64  # tokens per tile of the kernel (stream_attention.cpp), the largest group it decodes at once
HEAD_DIMS = (32, 64, 128, 256)  # the head dimensions the kernel is compiled for (its `switch (dim)`)


def _tiles(q, dim: int) -> bool:
    return q is None or dim % q.fmt.block_size == 0


GROUPED = (AdaptiveStream, ChannelStream)  # coded a group of tokens at a time per channel: read as keys only


def _reads(stream: StreamLayout) -> bool:
    """Plain and delta streams whose blocks tile the head dimension, and per-channel group streams (adaptive, and
    KIVI-style blocks of at most a tile of tokens)."""
    if isinstance(stream, PlainStream):
        return _tiles(stream.blocks, stream.dim)
    if isinstance(stream, AdaptiveStream):
        return stream.dim % 2 == 0
    if isinstance(stream, ChannelStream):
        return stream.group <= TILE and (stream.groups is None or stream.groups.fmt.name != "f16")
    if isinstance(stream, DeltaStream):
        return _tiles(stream.keyframes, stream.dim) and _tiles(stream.deltas, stream.dim)
    return False


def supports(keys: StreamLayout, values: StreamLayout) -> bool:
    """Whether the kernel reads this pair: both streams readable, per-channel groups only as keys, and work items
    that can start on a boundary of both (adaptive groups offset by sinks never meet delta values' keyframes)."""
    if not (_reads(keys) and _reads(values)) or isinstance(values, GROUPED):
        return False
    return not (isinstance(keys, AdaptiveStream) and keys.offset and isinstance(values, DeltaStream))


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: StreamLayout,
    values: StreamLayout,
    *,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
    extension,
) -> torch.Tensor:
    """Run the compiled kernel; arguments as in `reference.stream_attention`, the RoPE as (positions, freqs) tensors
    (empty: none; `kernels._rope_arguments`), the C++ side reading the layouts' fields by name."""
    aligned = _aligned(keys, values)
    split = -(-TOKENS_PER_ITEM // aligned) * aligned  # delta streams: every work item starts on a keyframe
    return extension.stream_attention(
        query.float().contiguous(),
        sink_keys.float().contiguous(),
        sink_values.float().contiguous(),
        keys,
        values,
        *rope,
        mask.to(torch.uint8).contiguous() if mask is not None else EMPTY_BYTES,
        n_queries,
        causal_offset,
        float(scale),
        split,
    )


def adaptive_step(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tail: torch.Tensor,
    values: QuantizedTensor,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    *,
    held: int,
    coded: int,
    pad: int,
    rotation: int,
    n_queries: int,
    scale: float,
    extension,
) -> torch.Tensor:
    """`kernels.adaptive_step` by the compiled kernel: `query` `[batch, kv_heads, rows, dim]`, `mask` bool `[batch,
    n_queries, max_cache_len]` with contiguous rows (or None), the storage's buffers whole (`groups`: planes, depths,
    low, step), no layout object."""
    group = groups[0].shape[-1] * 8
    split = -(-TOKENS_PER_ITEM // group) * group
    return extension.adaptive_step(
        query, sink_keys, sink_values, *groups, tail, values.codes,
        EMPTY_HALF if values.scales is None else values.scales, EMPTY_HALF if values.mins is None else values.mins,
        positions,
        EMPTY_DOUBLE if freqs is None else freqs, EMPTY_LONG if order is None else order,
        EMPTY_BOOL if mask is None else mask, held, coded, pad, group, int(values.fmt.kind), values.fmt.block_size,
        rotation, n_queries, float(scale), split,
    )  # fmt: skip


DECODED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what `decode_into` writes


def decodes(stream: StreamLayout, out: torch.Tensor) -> bool:
    """Whether `decode_into` serves this stream and output: a stream the attention kernel reads, a head dimension it
    is compiled for, an output of `DECODED_DTYPES` with contiguous rows."""
    return _reads(stream) and stream.dim in HEAD_DIMS and out.dtype in DECODED_DTYPES and out.stride(-1) == 1


def _aligned(*streams: StreamLayout) -> int:
    """The token multiple work items start on: every delta stream's keyframe interval and every group."""
    return math.lcm(*(s.kf if isinstance(s, DeltaStream) else getattr(s, "group", 1) for s in streams))


def decode_into(
    stream: StreamLayout, out: torch.Tensor, rope_arguments: tuple[torch.Tensor, torch.Tensor],
    order: torch.Tensor | None, extension,
) -> None:  # fmt: skip
    """`reference.decode_into` by the compiled kernel (`decodes` must hold): the RoPE as (positions, freqs) tensors
    (empty: none), work items of `TOKENS_PER_ITEM` tokens (rounded to the stream's groups) spread over the threads."""
    span = math.lcm(-(-TOKENS_PER_ITEM // _aligned(stream)) * _aligned(stream), TILE)
    scale = rotation_scale(stream.rotation) if stream.rotation else 1.0
    extension.decode_into(stream, out, *rope_arguments, EMPTY_LONG if order is None else order, scale, span)
