"""Triton kernel: the residual cache's packed latent groups to the fp32 latent (residual reconstruction's first
step; the decoder matmul follows in PyTorch). Specification: `reference.dequantize_latent`.

One program decodes one group of one token: its `GROUP` codes are read from a little-endian bit stream (a code of
b <= 8 bits spans at most two bytes), offset by `2**(b-1) - 1` and multiplied by the group's fp16 scale. Groups of
depth 0 decode as zeros. Per-group depth, byte offset and scale index come in small int32 tables, so one compiled
kernel serves every layer's allocation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...quant.bitpack import GROUP
from .common import EXACT, on_device, program


@triton.jit
def _dequantize_latent_kernel(
    packed_ptr,
    scales_ptr,
    bits_ptr,
    offsets_ptr,
    scale_index_ptr,
    out_ptr,
    code_bytes,
    n_scales,
    n_groups,
    GROUP_SIZE: tl.constexpr,
):
    row = program(0)
    group = program(1)
    bits = tl.load(bits_ptr + group)
    offset = tl.load(offsets_ptr + group)
    scale_index = tl.load(scale_index_ptr + group)
    j = tl.arange(0, GROUP_SIZE)
    kept = (j * 0 + bits) > 0
    safe_bits = tl.maximum(bits, 1)
    bit_position = j * safe_bits
    byte = row * code_bytes + offset + bit_position // 8
    shift = bit_position % 8
    low = tl.load(packed_ptr + byte, mask=kept, other=0).to(tl.int32)
    high = tl.load(packed_ptr + byte + 1, mask=kept & (shift + safe_bits > 8), other=0).to(tl.int32)
    code = ((low | (high << 8)) >> shift) & ((1 << safe_bits) - 1)
    qmax = (1 << (safe_bits - 1)) - 1
    scale_at = scales_ptr + row * n_scales + tl.maximum(scale_index, 0) + j * 0
    scale = tl.load(scale_at, mask=kept, other=0.0).to(tl.float32)
    value = tl.where(kept, (code - qmax).to(tl.float32) * scale, 0.0)
    tl.store(out_ptr + (row * n_groups + group) * GROUP_SIZE + j, value)


def dequantize_latent(packed: torch.Tensor, scales: torch.Tensor, bits: list[int]) -> torch.Tensor:
    """Triton version of `reference.dequantize_latent`."""
    lead = packed.shape[:-1]
    rows = packed.reshape(-1, packed.shape[-1]).contiguous()
    scale_rows = scales.reshape(-1, scales.shape[-1]).contiguous()
    offsets, index, byte, kept = [], [], 0, 0
    for b in bits:
        offsets.append(byte)
        index.append(kept if b else -1)
        byte += GROUP * b // 8
        kept += 1 if b else 0
    if byte != rows.shape[-1] or kept != scale_rows.shape[-1]:
        raise ValueError(
            f"bit depths {bits} need {byte} bytes and {kept} scales per token, got "
            f"{rows.shape[-1]} and {scale_rows.shape[-1]}"
        )
    device = packed.device
    table = _tables(tuple(bits), tuple(offsets), tuple(index), device)
    out = torch.empty(rows.shape[0], len(bits) * GROUP, dtype=torch.float32, device=device)
    if rows.shape[0]:
        grid = (rows.shape[0], len(bits))
        on_device(_dequantize_latent_kernel)[grid](
            rows, scale_rows, *table, out, rows.shape[-1], scale_rows.shape[-1], len(bits), GROUP_SIZE=GROUP, **EXACT
        )
    return out.reshape(*lead, len(bits) * GROUP)


@functools.cache
def _tables(*columns_and_device) -> list[torch.Tensor]:
    """The kernel's int32 tables (depths, byte offsets, scale columns) on the device, made once per layout and device
    (a copy from the host at every call would stall a GPU's queue)."""
    *columns, device = columns_and_device
    return [torch.tensor(column, dtype=torch.int32, device=device) for column in columns]
