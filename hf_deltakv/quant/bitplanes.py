"""Codes of per-channel bit depth over a group of tokens, stored as bit planes.

A group holds `G` tokens of `D` channels; channel `c` has codes of `bits[c]` bits (1..8). Plane `k` of a channel is
bit `k` of its `G` codes, `G / 8` bytes (bit `j` of the plane is token `j`, little-endian). A group stores the planes
of channel 0, then of channel 1, ...: with a fixed budget of `planes = sum(bits)` per group, every group has the same
size, and a channel's planes start after the planes of the channels before it. Decoding a channel is a few shifts and
masks per plane, the same for every depth, which vectorises over tokens.
"""

from __future__ import annotations

import torch

MAX_BITS = 8


def _plane_mask(bits: torch.Tensor) -> torch.Tensor:
    """bool `[..., D * 8]`: which of the 8 possible planes of each channel are stored (k < bits[c])."""
    k = torch.arange(MAX_BITS, device=bits.device)
    return (k < bits.unsqueeze(-1).long()).flatten(-2)


def pack_planes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Codes `uint8 [..., G, D]` (each < 2 ** bits[c]) and depths `[..., D]` to planes `uint8 [..., sum(bits), G/8]`
    (every group of the batch must have the same `sum(bits)`)."""
    *lead, group, dim = codes.shape
    if group % 8:
        raise ValueError(f"a group of tokens must be a multiple of 8, got {group}")
    shifts = torch.arange(MAX_BITS, device=codes.device)
    bit = (codes.to(torch.int32).transpose(-1, -2).unsqueeze(-2) >> shifts.view(MAX_BITS, 1)) & 1  # [..., D, 8, G]
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    planes = (bit.view(*lead, dim, MAX_BITS, group // 8, 8) * weights).sum(-1).to(torch.uint8)  # [..., D, 8, G/8]
    flat = planes.reshape(-1, dim * MAX_BITS, group // 8)
    mask = _plane_mask(bits).reshape(-1, dim * MAX_BITS)
    counts = mask.sum(-1)
    if counts.numel() and not (counts == counts[0]).all():
        raise ValueError("every group must store the same number of planes")
    total = int(counts[0]) if counts.numel() else 0
    return flat[mask].view(*lead, total, group // 8)


def unpack_planes(planes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_planes`: planes `uint8 [..., P, G/8]` and depths `[..., D]` to codes `int32 [..., G, D]`."""
    *lead, _, width = planes.shape
    dim = bits.shape[-1]
    mask = _plane_mask(bits).reshape(-1, dim * MAX_BITS)
    full = planes.new_zeros(mask.shape[0], dim * MAX_BITS, width)
    full[mask] = planes.reshape(-1, width)
    bit = (full.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=planes.device)) & 1  # [N, D*8, G/8, 8]
    bit = bit.view(-1, dim, MAX_BITS, width * 8)
    codes = (bit << torch.arange(MAX_BITS, device=planes.device).view(MAX_BITS, 1)).sum(-2)  # [N, D, G]
    return codes.transpose(-1, -2).reshape(*lead, width * 8, dim)
