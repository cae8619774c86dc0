"""Orthogonal Hadamard rotation of head vectors before quantization.

Spreading each vector's energy evenly over its channels removes the outlier channels that ruin per-token 4-bit
scales (llama.cpp rotates its quantized KV cache the same way). The rotation is orthogonal, so it changes neither
dot products nor, once undone, the decoded values beyond quantization error.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .base import StreamCodec


def rotation_block(dim: int) -> int:
    """Largest power of two (up to 128) dividing `dim`: the size of the block-diagonal Hadamard used."""
    if dim < 1:
        raise ValueError(f"head dimension must be positive, got {dim}")
    block = 1
    while dim % (block * 2) == 0 and block < 128:
        block *= 2
    return block


@lru_cache(maxsize=16)
def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo) the block-diagonal Hadamard rotation along the last dimension, in fp32."""
    dim = x.shape[-1]
    block = rotation_block(dim)
    h = _hadamard(block).to(x.device)
    if inverse:
        h = h.T
    y = x.float().reshape(*x.shape[:-1], dim // block, block) @ h
    return y.reshape(*x.shape[:-1], dim)


class RotatedCodec(StreamCodec):
    """Wraps a codec so that it codes Hadamard-rotated head vectors and decodes back to the original basis."""

    def __init__(self, inner: StreamCodec) -> None:  # no super().__init__(): the inner codec keeps the length
        self.inner = inner

    @property
    def length(self) -> int:
        return self.inner.length

    def state_names(self) -> tuple[str, ...]:
        return ()

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def map_batch(self, fn) -> None:
        self.inner.map_batch(fn)

    def append(self, x: torch.Tensor) -> None:
        self.inner.append(rotate(x))

    def decode_range(self, start: int, end: int) -> torch.Tensor:
        return rotate(self.inner.decode_range(start, end), inverse=True)
