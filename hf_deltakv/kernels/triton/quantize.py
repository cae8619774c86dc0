"""Quantizing into llama.cpp's block formats on GPUs. Specification: `hf_deltakv.quant.quantize` (byte-identical
codes and scales).

`quantize` runs the appends' kernel (`append.quantize_at`, every format, the scale search too) with each block a row;
`q4_0_halves` is q4_0's arithmetic on blocks held as their two halves (byte j of a block packs code j, low nibble,
with code j + block/2, llama.cpp's order), for the delta kernels that code against a reference in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import QuantizedTensor, get_format
from .append import quantize_at
from .common import FP16_MAX


@triton.jit
def _reciprocal(d):
    """1 / d, 0 for d = 0, correctly rounded (`div_rn`: a GPU's `/` may be approximate; the reference's is not)."""
    return tl.where(d == 0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d == 0, 1.0, d)))


@triton.jit
def q4_0_halves(lo, hi, cols, HALF: tl.constexpr):
    """q4_0 of blocks given as halves `[rows, HALF]`: unclipped codes of each half (fp32; NaN for a block holding NaN,
    ±inf for an infinite element: the caller codes both 0, `common.finite_or_zero`) and the fp32 scale as stored
    (signed value of largest magnitude / -8, first one on ties as torch.argmax, saturated to the fp16 range; NaN for a
    block that is not all finite), as `quant.quantize` codes."""
    a_lo = tl.abs(lo)
    a_hi = tl.abs(hi)
    nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), axis=1) > 0  # (tl.max ignores NaN; torch's argmax finds it)
    infinite = tl.max(((a_lo == float("inf")) | (a_hi == float("inf"))).to(tl.int32), axis=1) > 0
    m = tl.maximum(tl.max(a_lo, axis=1), tl.max(a_hi, axis=1))
    idx_lo = tl.min(tl.where(a_lo == m[:, None], cols[None, :], 2 * HALF), axis=1)
    idx_hi = tl.min(tl.where(a_hi == m[:, None], cols[None, :] + HALF, 2 * HALF), axis=1)
    idx = tl.minimum(idx_lo, idx_hi)
    v = tl.sum(tl.where(cols[None, :] == idx[:, None], lo, 0.0), axis=1) + tl.sum(
        tl.where(cols[None, :] + HALF == idx[:, None], hi, 0.0), axis=1
    )
    d = tl.minimum(tl.maximum(tl.math.div_rn(v, tl.full(v.shape, -8.0, tl.float32)), -FP16_MAX), FP16_MAX)
    d = tl.where(nan, float("nan"), d)
    inv = _reciprocal(d)
    return tl.floor(lo * inv[:, None] + 8.5), tl.floor(hi * inv[:, None] + 8.5), tl.where(infinite, float("nan"), d)


def quantize(x: torch.Tensor, fmt_name: str, search_scale: bool = False) -> QuantizedTensor:
    """`quant.quantize` of every block format, as the appends' kernel codes rows (`append.quantize_at`: the same
    arithmetic, exact division, NaN and ±inf as the reference treats them): each block one row of `[1, 1, blocks,
    block]`."""
    fmt = get_format(fmt_name)
    if fmt.name == "f16":
        raise ValueError("f16 needs no kernel; use hf_deltakv.quant.quantize")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    lead, dim, block = x.shape[:-1], x.shape[-1], fmt.block_size
    pad = -dim % block
    rows = torch.nn.functional.pad(x.float(), (0, pad)).reshape(1, 1, -1, block)
    out = QuantizedTensor.empty(fmt, (1, 1, rows.shape[2]), block, x.device)
    quantize_at(rows, fmt_name, search_scale, out, 0)
    blocks = (*lead, (dim + pad) // block)
    parts = (None if t is None else t.reshape(*blocks, *t.shape[4:]) for t in (out.codes, out.scales, out.mins))
    return QuantizedTensor(fmt, dim, *parts)
