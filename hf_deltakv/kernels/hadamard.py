"""Orthogonal block-diagonal Hadamard rotation of head vectors (the reference every kernel's rotation follows).

Spreading each vector's energy evenly over its channels removes the outlier channels that ruin per-token 4-bit
scales (llama.cpp rotates its quantized KV cache the same way). The rotation is orthogonal, so it changes neither
dot products nor, once undone, the decoded values beyond quantization error.
"""

from __future__ import annotations

import functools
import math
import struct
from functools import lru_cache

import torch

MAX_BLOCK = 128  # the largest Hadamard block used (a power of two dividing the head dimension)
# Finite inputs are clamped to ±ROTATION_LIMIT before the butterflies (NaN and ±inf kept: non-finite in, non-finite
# out), so that the sums of up to MAX_BLOCK of them stay finite in fp32 (2**120 * 128 = 2**127 < fp32's max): finite
# in, finite out. Values this large saturate every fp16 scale anyway (fp16's max is 65504), so nothing a quantizer can
# store changes. The C++ and Triton rotations are handed this value (the one definition).
ROTATION_LIMIT = 2.0**120


def rotation_block(dim: int) -> int:
    """Largest power of two (up to `MAX_BLOCK`) dividing `dim`: the size of the block-diagonal Hadamard used."""
    if dim < 1:
        raise ValueError(f"head dimension must be positive, got {dim}")
    block = 1
    while dim % (block * 2) == 0 and block < MAX_BLOCK:
        block *= 2
    return block


def rotation_scale(block: int) -> float:  # (not cached: a compiled graph traces it, and it costs a struct round trip)
    """The normalisation `1 / sqrt(block)` as the fp32 number every implementation multiplies by (the one definition:
    the C++ and Triton kernels are handed this value)."""
    return struct.unpack("f", struct.pack("f", 1.0 / math.sqrt(block)))[0]


@lru_cache(maxsize=16)
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal `n × n` Hadamard matrix (Sylvester's construction, `n` a power of two), fp32 on the CPU: what
    `rotate` multiplies by (up to rounding)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@functools.cache
def rotation_matrix(dim: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `dim × dim` block-diagonal matrix `H` with `rotate(x) == x @ H` up to rounding (identity when `block` is
    0): made once per device and kept (a kernel asks at every call; not to be written into)."""
    if not block:
        return torch.eye(dim, device=device)
    return torch.block_diag(*[hadamard(block)] * (dim // block)).to(device)


def rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo: the matrix is its own inverse) the block-diagonal Hadamard rotation along the last dimension,
    in fp32.

    Computed by Walsh-Hadamard butterflies on the input, its finite values clamped to ±`ROTATION_LIMIT`: stages `h =
    1, 2, 4, ...` turn each pair of channels `(i, i + h)` of a block (bit `h` of `i` clear) into `(a + b, a - b)`,
    then every channel is multiplied by `rotation_scale(block)`.
    Each row is rotated on its own by the same fp32 operations in the same order, so a token's rotation does not
    depend on what is rotated with it (a matrix product's rounding does), and the C++ and Triton kernels, which
    follow these steps, give the same floats."""
    del inverse  # Sylvester's H is symmetric and orthogonal: H^-1 = H
    dim = x.shape[-1]
    block = rotation_block(dim)
    y = x.float()
    y = torch.where(y.isinf(), y, y.clamp(-ROTATION_LIMIT, ROTATION_LIMIT))  # finite sums of finite inputs
    lead = y.shape[:-1]
    h = 1
    while h < block:
        pairs = y.reshape(*lead, dim // (2 * h), 2, h)
        a, b = pairs.select(-2, 0), pairs.select(-2, 1)
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, dim)
        h *= 2
    return y * rotation_scale(block)
