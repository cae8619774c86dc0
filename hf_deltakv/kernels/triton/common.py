"""Device functions the Triton kernels share, each the arithmetic of a PyTorch reference in the same IEEE operations
and order (kernels whose results are held to the reference's bytes launch with `EXACT`: no mul+add contraction).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...quant.blocks import FP16_MAX as FP16_MAX_VALUE
from ...quant.table import Kind

FP16_MAX = tl.constexpr(FP16_MAX_VALUE)
TILE_KINDS = (Kind.Q4_SYM, Kind.Q4_ASYM, Kind.Q8)  # the block arithmetic every attention kernel decodes values in
# Launch options of kernels held to a reference's floats: no fused multiply-add where the reference rounds twice.
EXACT = {"enable_fp_fusion": False}


def log2_of(block: int) -> int:
    """Butterfly stages of a Hadamard block (`block` a power of two; 0 for no rotation)."""
    return max(int(block).bit_length() - 1, 0)


@triton.jit
def butterflies(x, R: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr, SCALE: tl.constexpr):
    """`hadamard.rotate` of rows `x` fp32 `[R, D]`: stages h = 1, 2, ... 2**(STAGES - 1), each pair of channels
    `(i, i + h)` (bit h of i clear) to `(a + b, a - b)`, then times SCALE (`hadamard.rotation_scale`)."""
    for s in tl.static_range(STAGES):
        y = tl.permute(tl.reshape(x, (R, D // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))
    return x * SCALE


@triton.jit
def saturate_fp16(x):
    """`quant.saturate_fp16` before the conversion: clamped to fp16's finite range, NaN kept."""
    return tl.where(x > FP16_MAX, FP16_MAX, tl.where(x < -FP16_MAX, -FP16_MAX, x))


@triton.jit
def rope_cos_sin(positions, freqs):
    """`rope.rope_cos_sin`: cos and sin fp32 of `positions * freqs`, the angle (and its cos and sin) in float64.
    `positions` int `[..., 1]`-broadcastable against `freqs` float64."""
    angle = positions.to(tl.float64) * freqs
    return tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32)


@triton.jit
def turned_cos_sin(positions, freqs):
    """cos and sin fp32 of `positions * freqs` (int, float64) for the attention kernels, within ~2e-7 of
    `rope_cos_sin`: the angle in float64 reduced to a quarter turn r in [-pi/4, pi/4] (in float64), then fp32
    polynomials of r (a sine of degree 7, a cosine of degree 8: minimax on the quarter turn, as in Cephes' sinf) and
    the quadrant's signs. Plain multiply-adds: no transcendental library call, whose slow paths take stack memory
    on GPUs."""
    angle = positions.to(tl.float64) * freqs
    turns = tl.floor(angle * 0.6366197723675814 + 0.5)  # quarter turns: angle / (pi / 2), rounded
    r = (angle - turns * 1.5707963267948966).to(tl.float32)
    quadrant = turns.to(tl.int64) & 3
    r2 = r * r
    sine = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    cosine = (
        1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    )
    cos = tl.where((quadrant & 1) == 1, sine, cosine)
    sin = tl.where((quadrant & 1) == 1, cosine, sine)
    cos = tl.where((quadrant == 1) | (quadrant == 2), -cos, cos)
    sin = tl.where(quadrant >= 2, -sin, sin)
    return cos, sin


@triton.jit
def round_half_even(x):
    """`torch.round` (half to even) of fp32 `x` with |x| < 2**22 (larger values are clamped by every caller)."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr):
    """fp32 `x` in DTYPE, rounded to nearest even (bf16 by hand: Triton's interpreter truncates; GPUs round the same
    way as this)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, float("nan"), rounded.to(tl.float32)).to(tl.bfloat16)
    return x.to(DTYPE)


@triton.jit
def query_halves(q_ptr, b, h, sqb, sqh, sqg, lo_at, hi_at, GROUP: tl.constexpr, G_PAD: tl.constexpr):
    """fp32 `[G_PAD, D/2]` pair halves of the queries of kv head `h` (its `GROUP` query heads: rows past them zeros),
    channels `lo_at` and `hi_at` of each row (`c` and `c + D/2`, or a canonical order's)."""
    g = tl.arange(0, G_PAD)
    rows = q_ptr + b * sqb + h * sqh + g[:, None] * sqg
    live = (g < GROUP)[:, None]
    lo = tl.load(rows + lo_at[None, :], mask=live, other=0.0).to(tl.float32)
    return lo, tl.load(rows + hi_at[None, :], mask=live, other=0.0).to(tl.float32)
