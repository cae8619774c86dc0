"""Triton kernels: quantize + pack into llama.cpp block formats (q4_0, q4_1, q8_0 and our 16-wide variants).
Specification: `hf_deltakv.quant.quantize` (byte-identical codes and scales).

Each program handles `ROWS` blocks. A 4-bit block is loaded as its two halves, because byte j of a block packs
code j (low nibble) with code j + block/2 (high nibble), llama.cpp's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Kind, QuantizedTensor, get_format
from ...quant.blocks import FP16_MAX as FP16_MAX_VALUE

FP16_MAX = tl.constexpr(FP16_MAX_VALUE)  # where scales saturate, as in the reference
ROWS = 16


@triton.jit
def _scale_out(d, finite):
    """fp16 scale as the reference stores it: saturated, NaN where the block is not finite."""
    d = tl.minimum(tl.maximum(d, -FP16_MAX), FP16_MAX)
    return tl.where(finite, d, float("nan"))


@triton.jit
def _reciprocal(d):
    return tl.where(d == 0, 0.0, 1.0 / tl.where(d == 0, 1.0, d))


@triton.jit
def q4_0_halves(lo, hi, cols, HALF: tl.constexpr):
    """q4_0 of blocks given as halves `[rows, HALF]`: unclipped codes of each half (fp32) and the fp32 scale
    (signed value of largest magnitude / -8, first one on ties as torch.argmax, saturated to the fp16 range)."""
    a_lo = tl.abs(lo)
    a_hi = tl.abs(hi)
    m = tl.maximum(tl.max(a_lo, axis=1), tl.max(a_hi, axis=1))
    idx_lo = tl.min(tl.where(a_lo == m[:, None], cols[None, :], 2 * HALF), axis=1)
    idx_hi = tl.min(tl.where(a_hi == m[:, None], cols[None, :] + HALF, 2 * HALF), axis=1)
    idx = tl.minimum(idx_lo, idx_hi)
    v = tl.sum(tl.where(cols[None, :] == idx[:, None], lo, 0.0), axis=1) + tl.sum(
        tl.where(cols[None, :] + HALF == idx[:, None], hi, 0.0), axis=1
    )
    d = tl.minimum(tl.maximum(v / -8, -FP16_MAX), FP16_MAX)
    inv = _reciprocal(d)
    return tl.floor(lo * inv[:, None] + 8.5), tl.floor(hi * inv[:, None] + 8.5), d


@triton.jit
def _quantize_4bit_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, n_blocks, ASYMMETRIC: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HALF)
    mask = rows[:, None] < n_blocks
    base = x_ptr + rows[:, None] * (2 * HALF) + cols[None, :]
    lo_half = tl.load(base, mask=mask, other=0.0)
    hi_half = tl.load(base + HALF, mask=mask, other=0.0)
    finite = (
        tl.sum(((lo_half == lo_half) & (tl.abs(lo_half) != float("inf"))).to(tl.int32), axis=1)
        + tl.sum(((hi_half == hi_half) & (tl.abs(hi_half) != float("inf"))).to(tl.int32), axis=1)
        == 2 * HALF
    )
    if ASYMMETRIC:
        hi = tl.maximum(tl.max(lo_half, axis=1), tl.max(hi_half, axis=1))
        lo = tl.minimum(tl.min(lo_half, axis=1), tl.min(hi_half, axis=1))
        lo = tl.minimum(tl.maximum(lo, -FP16_MAX), FP16_MAX)
        d = tl.minimum(tl.maximum((hi - lo) / 15, -FP16_MAX), FP16_MAX)
        inv = _reciprocal(d)
        q_lo = tl.floor((lo_half - lo[:, None]) * inv[:, None] + 0.5)
        q_hi = tl.floor((hi_half - lo[:, None]) * inv[:, None] + 0.5)
        tl.store(mins_ptr + rows, tl.where(finite, lo, float("nan")).to(tl.float16), mask=rows < n_blocks)
    else:
        q_lo, q_hi, d = q4_0_halves(lo_half, hi_half, cols, HALF)
    q_lo = tl.minimum(tl.maximum(tl.where(q_lo == q_lo, q_lo, 0.0), 0.0), 15.0).to(tl.uint8)
    q_hi = tl.minimum(tl.maximum(tl.where(q_hi == q_hi, q_hi, 0.0), 0.0), 15.0).to(tl.uint8)
    tl.store(codes_ptr + rows[:, None] * HALF + cols[None, :], q_lo | (q_hi << 4), mask=mask)
    tl.store(scales_ptr + rows, _scale_out(d, finite).to(tl.float16), mask=rows < n_blocks)


@triton.jit
def _quantize_q8_0_kernel(x_ptr, codes_ptr, scales_ptr, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = rows[:, None] < n_blocks
    x = tl.load(x_ptr + rows[:, None] * BLOCK + cols[None, :], mask=mask, other=0.0)
    finite = tl.sum(((x == x) & (tl.abs(x) != float("inf"))).to(tl.int32), axis=1) == BLOCK
    d = tl.minimum(tl.max(tl.abs(x), axis=1) / 127, FP16_MAX)
    scaled = x * _reciprocal(d)[:, None]
    q = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(-scaled + 0.5))  # round half away from zero
    q = tl.minimum(tl.maximum(tl.where(q == q, q, 0.0), -127.0), 127.0).to(tl.int8)
    tl.store(codes_ptr + rows[:, None] * BLOCK + cols[None, :], q, mask=mask)
    tl.store(scales_ptr + rows, _scale_out(d, finite).to(tl.float16), mask=rows < n_blocks)


def quantize(x: torch.Tensor, fmt_name: str) -> QuantizedTensor:
    """Triton version of `quant.quantize` for q4_0, q4_1, q8_0, q4_0_16 and q4_1_16."""
    fmt = get_format(fmt_name)
    if fmt.name == "f16":
        raise ValueError("f16 needs no kernel; use hf_deltakv.quant.quantize")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    lead, dim, block = x.shape[:-1], x.shape[-1], fmt.block_size
    pad = -dim % block
    flat = torch.nn.functional.pad(x.float(), (0, pad)).reshape(-1, block).contiguous()
    n_blocks = flat.shape[0]
    scales = torch.empty(n_blocks, dtype=torch.float16, device=x.device)
    grid = (triton.cdiv(n_blocks, ROWS),)
    blocks_shape = (*lead, (dim + pad) // block)
    if fmt.bits == 8:
        codes = torch.empty(n_blocks, block, dtype=torch.int8, device=x.device)
        _quantize_q8_0_kernel[grid](flat, codes, scales, n_blocks, BLOCK=block, ROWS=ROWS)
        return QuantizedTensor(
            fmt, dim, codes.view(torch.uint8).reshape(*blocks_shape, block), scales.reshape(blocks_shape)
        )
    asymmetric = fmt.kind == Kind.Q4_ASYM
    codes = torch.empty(n_blocks, block // 2, dtype=torch.uint8, device=x.device)
    mins = torch.empty(n_blocks, dtype=torch.float16, device=x.device) if asymmetric else scales
    _quantize_4bit_kernel[grid](flat, codes, scales, mins, n_blocks, ASYMMETRIC=asymmetric, HALF=block // 2, ROWS=ROWS)
    return QuantizedTensor(
        fmt,
        dim,
        codes.reshape(*blocks_shape, block // 2),
        scales.reshape(blocks_shape),
        mins.reshape(blocks_shape) if asymmetric else None,
    )
