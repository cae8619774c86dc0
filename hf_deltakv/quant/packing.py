"""Bit packing of block codes: two 4-bit codes per byte, in llama.cpp's order (byte j of a block holds code j low and
code j + 16 high), and 3-bit codes as 2-bit low parts plus a plane of high bits."""

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


def pack_3bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes `[..., 32]` (uint8 values 0..7) into 12 bytes `[..., 12]`: byte j (0-7) holds the low 2 bits of codes
    j, j + 8, j + 16 and j + 24 (at bits 0, 2, 4, 6); byte 8 + i holds the high bits of codes 8i..8i+7 (bit k: code
    8i + k)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_3bit expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] != 32:
        raise ValueError(f"pack_3bit packs blocks of 32 codes, got {codes.shape[-1]}")
    low = (codes & 3).view(*codes.shape[:-1], 4, 8)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)
    low_bytes = (low << shifts[:, None]).sum(-2, dtype=torch.uint8)
    high = (codes >> 2).view(*codes.shape[:-1], 4, 8)
    bits = torch.arange(8, dtype=torch.uint8, device=codes.device)
    high_bytes = (high << bits).sum(-1, dtype=torch.uint8)
    return torch.cat([low_bytes, high_bytes], dim=-1)


def unpack_3bit(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_3bit`: bytes `[..., 12]` to codes `[..., 32]`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_3bit expects uint8, got {packed.dtype}")
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)
    low = (packed[..., None, :8] >> shifts[:, None]) & 3  # [..., 4, 8]: code 8i + j
    bits = torch.arange(8, dtype=torch.uint8, device=packed.device)
    high = (packed[..., 8:, None] >> bits) & 1  # [..., 4, 8]
    return (low | (high << 2)).flatten(-2)
