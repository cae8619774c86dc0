"""A codec's packed storage as flat tensors plus integer metadata: what fused attention kernels read.

`describe` returns None for storage a kernel does not read (ChannelGroupCodec, keyframe-referenced deltas, formats
whose blocks do not tile the head dimension); callers then use the chunked reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import QuantizedTensor
from .base import StreamCodec
from .delta import DeltaCodec
from .plain import PlainCodec
from .rotation import RotatedCodec, rotation_block

PLAIN, DELTA = 0, 1
F16, Q4_SYM, Q4_ASYM, Q8 = 0, 1, 2, 3


@dataclass
class StreamLayout:
    """Kernel arguments of one stream.

    tensors: codes, scales, mins (plain); or delta codes, scales, mins, keyframe codes, scales, mins, fp16 means.
        Absent tensors are empty; every tensor is contiguous with `[batch, heads, rows, ...]` leading dimensions.
    meta: kind, rotation block (0: none), format, block size, then for deltas keyframe format, keyframe block, kf,
        intra (0/1).
    """

    tensors: list[torch.Tensor]
    meta: list[int]


def _format_id(q: QuantizedTensor) -> int:
    if q.fmt.name == "f16":
        return F16
    if q.fmt.bits == 8:
        return Q8
    return Q4_ASYM if q.mins is not None else Q4_SYM


EMPTY_BYTES = torch.empty(0, dtype=torch.uint8)  # absent tensors (the kernels read CPU tensors only)
EMPTY_HALF = torch.empty(0, dtype=torch.float16)


def _blocks(q: QuantizedTensor | None, dim: int) -> tuple[list[torch.Tensor], list[int]] | None:
    """(codes as bytes, scales, mins) and (format, block); None when the blocks do not tile `dim` exactly."""
    if q is None:
        return [EMPTY_BYTES, EMPTY_HALF, EMPTY_HALF], [F16, 1]
    block = q.fmt.block_size
    if dim % block:
        return None
    codes = q.codes.contiguous().view(torch.uint8)
    scales = q.scales.contiguous() if q.scales is not None else EMPTY_HALF
    mins = q.mins.contiguous() if q.mins is not None else EMPTY_HALF
    return [codes, scales, mins], [_format_id(q), block]


def describe(codec: StreamCodec, dim: int) -> StreamLayout | None:
    """The layout of `codec`'s storage of `dim`-wide head vectors, or None if no kernel reads it."""
    rotation = 0
    if isinstance(codec, RotatedCodec):
        rotation, codec = rotation_block(dim), codec.inner
    if isinstance(codec, PlainCodec) and codec.stored is not None:
        blocks = _blocks(codec.stored, dim)
        return None if blocks is None else StreamLayout(blocks[0], [PLAIN, rotation, *blocks[1]])
    if isinstance(codec, DeltaCodec) and codec.reference == "previous" and codec.keyframes is not None:
        deltas = _blocks(codec.deltas, dim)
        keyframes = _blocks(codec.keyframes, dim)
        if deltas is None or keyframes is None:
            return None
        means = codec.means.contiguous() if codec.means is not None and codec.mean_reference else EMPTY_HALF
        meta = [DELTA, rotation, *deltas[1], *keyframes[1], codec.kf, int(codec.intra)]
        return StreamLayout([*deltas[0], *keyframes[0], means], meta)
    return None
