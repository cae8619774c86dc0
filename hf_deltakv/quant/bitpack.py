"""Symmetric b-bit group quantization with codes packed at exactly b bits each (b in 2..8).

The learned residual cache gives each group of latent components its own bit depth (more bits where the variance
is), so it needs widths llama.cpp's formats do not have. A group of `GROUP` values shares one fp16 scale
`absmax / qmax` with `qmax = 2**(b-1) - 1`; codes `round(x / scale)` in `[-qmax, qmax]` are stored offset by `qmax`
and packed little-endian, bit by bit, `GROUP * b / 8` bytes per group.
"""

from __future__ import annotations

import torch

from .blocks import FP16_MAX

GROUP = 32
BIT_DEPTHS = (2, 3, 4, 5, 6, 8)


def check_bits(bits: int) -> int:
    if bits not in BIT_DEPTHS:
        raise ValueError(f"bit depth must be one of {BIT_DEPTHS}, got {bits!r}")
    return bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes `[..., n]` (< 2**bits, n * bits a multiple of 8) into bytes `[..., n * bits // 8]`."""
    check_bits(bits)
    n = codes.shape[-1]
    if n * bits % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes")
    shifts = torch.arange(bits, device=codes.device)
    planes = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., n, bits]
    planes = planes.reshape(*codes.shape[:-1], n * bits // 8, 8)
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (planes * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: bytes `[..., m]` to codes `[..., m * 8 // bits]` (int32)."""
    check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_bits expects uint8, got {packed.dtype}")
    shifts = torch.arange(8, device=packed.device)
    planes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., m, 8]
    planes = planes.reshape(*packed.shape[:-1], packed.shape[-1] * 8 // bits, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (planes * weights).sum(-1)


def group_scales(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp16 scale `absmax / qmax` of each group of `x` `[..., GROUP]` (`[...]`), saturated to the fp16 range."""
    qmax = 2 ** (check_bits(bits) - 1) - 1
    return (x.abs().amax(-1) / qmax).clamp(max=FP16_MAX).to(torch.float16)


def quantize_group(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes `[..., GROUP]` (unsigned, offset by qmax) and fp16 scales `[...]` of groups `x` `[..., GROUP]`."""
    if x.shape[-1] != GROUP:
        raise ValueError(f"groups must have {GROUP} values, got {x.shape[-1]}")
    qmax = 2 ** (bits - 1) - 1
    scales = group_scales(x, bits)
    d = scales.float().unsqueeze(-1)
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(x.float() * inverse).clamp(-qmax, qmax) + qmax
    return codes.to(torch.uint8), scales


def dequantize_group(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Values `[..., GROUP]` in fp32 from unsigned codes and fp16 scales."""
    qmax = 2 ** (bits - 1) - 1
    return (codes.float() - qmax) * scales.float().unsqueeze(-1)


def fake_quantize_group(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`dequantize(quantize(x))` with a straight-through gradient (identity), for training through the codes."""
    codes, scales = quantize_group(x.detach(), bits)
    return x + (dequantize_group(codes, scales, bits) - x).detach()
