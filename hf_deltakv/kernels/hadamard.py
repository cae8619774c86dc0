"""Orthogonal block-diagonal Hadamard rotation of head vectors (the reference every kernel's rotation follows).

Spreading each vector's energy evenly over its channels removes the outlier channels that ruin per-token 4-bit
scales (llama.cpp rotates its quantized KV cache the same way). The rotation is orthogonal, so it changes neither
dot products nor, once undone, the decoded values beyond quantization error.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

MAX_BLOCK = 128  # the largest Hadamard block used (a power of two dividing the head dimension)


def rotation_block(dim: int) -> int:
    """Largest power of two (up to `MAX_BLOCK`) dividing `dim`: the size of the block-diagonal Hadamard used."""
    if dim < 1:
        raise ValueError(f"head dimension must be positive, got {dim}")
    block = 1
    while dim % (block * 2) == 0 and block < MAX_BLOCK:
        block *= 2
    return block


@lru_cache(maxsize=16)
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal `n × n` Hadamard matrix (Sylvester's construction, `n` a power of two), fp32 on the CPU."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotation_matrix(dim: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `dim × dim` block-diagonal matrix `H` with `rotate(x) == x @ H` (identity when `block` is 0)."""
    if not block:
        return torch.eye(dim, device=device)
    return torch.block_diag(*[hadamard(block)] * (dim // block)).to(device)


def rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo) the block-diagonal Hadamard rotation along the last dimension, in fp32."""
    dim = x.shape[-1]
    block = rotation_block(dim)
    h = hadamard(block).to(x.device)
    if inverse:
        h = h.T
    y = x.float().reshape(*x.shape[:-1], dim // block, block) @ h
    return y.reshape(*x.shape[:-1], dim)
