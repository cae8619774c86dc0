"""Two 4-bit codes per byte, in llama.cpp's order: byte j of a block holds code j (low) and code j + 16 (high)."""

from __future__ import annotations

import torch


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes `[..., block]` (uint8 values 0..15, even block) into bytes `[..., block // 2]`."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_4bit expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_4bit needs an even last dimension, got {codes.shape[-1]}")
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_4bit`: bytes `[..., n]` to codes `[..., 2 * n]`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_4bit expects uint8, got {packed.dtype}")
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)
