"""Device functions the Triton kernels share, each the arithmetic of a PyTorch reference in the same IEEE operations
and order (kernels whose results are held to the reference's bytes launch with `EXACT`: no mul+add contraction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...quant.blocks import FP16_MAX as FP16_MAX_VALUE
from ...quant.table import Kind
from ..hadamard import ROTATION_LIMIT as ROTATION_LIMIT_VALUE

FP16_MAX = tl.constexpr(FP16_MAX_VALUE)
ROTATION_LIMIT = tl.constexpr(ROTATION_LIMIT_VALUE)
TILE_KINDS = (Kind.Q4_SYM, Kind.Q4_ASYM, Kind.Q8)  # the block arithmetic every attention kernel decodes values in
# Launch options of kernels held to a reference's floats: no fused multiply-add where the reference rounds twice.
EXACT = {"enable_fp_fusion": False}
# Programs a launch's grid may hold on axes 0, 1 and 2 (CUDA's limits, HIP's the same or larger; the interpreter has
# none): a long dimension (tokens, groups, bytes) goes on axis 0.
GRID_LIMITS = (2**31 - 1, 65535, 65535)
ROW_BLOCK = 16  # query rows a program holds when a forward has several queries (a chunk): blocks of rows, grid axis 2
MAX_QUERIES = 64  # queries per kv head the attention kernels read together (more: a prefill, which decodes the history)


# The devices of the launches under way, innermost last (what `on_device` guards; tests read it to check each launch's
# tensors are on the device it launches on).
GUARDED: list[torch.device] = []


class on_device:
    """A launch under the device guard of its first tensor argument: Triton launches on torch's *current* device and
    its current stream, which need not be the tensors' (a model split by `device_map` over several GPUs), so every
    kernel is launched as `on_device(kernel)[grid](*args)`: on a CUDA (or ROCm) device inside `torch.cuda.device(...)`,
    elsewhere (the interpreter) as it is."""

    __slots__ = ("kernel",)

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            GUARDED.append(device)
            try:
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        return self.kernel[grid](*args, **kwargs)
                return self.kernel[grid](*args, **kwargs)
            finally:
                GUARDED.pop()

        return launch


@dataclass(frozen=True)
class Rows:
    """A forward's query rows of a kv head as the split and merge kernels take them: `n_queries` per query head (row
    `g * n_queries + i` is query `i` of head `g`, which sees tokens up to `causal_offset + i` without a mask), in
    `blocks` blocks of `block` rows (grid axis 2 of the splits, 1 of the merge)."""

    n_queries: int
    causal_offset: int
    block: int
    blocks: int


def query_rows(rows: int, n_queries: int = 1, causal_offset: int = 0) -> Rows:
    """The layout of `rows` query rows (query heads × queries): padded to a power of two in one block for one query,
    in blocks of at least `ROW_BLOCK` (and a query's heads) for several."""
    padded = max(triton.next_power_of_2(rows), 1)
    block = padded if n_queries == 1 else min(padded, max(ROW_BLOCK, triton.next_power_of_2(rows // n_queries)))
    return Rows(n_queries, causal_offset, block, triton.cdiv(rows, block))


def rows_of(mask: torch.Tensor | None, n_queries: int) -> bool:
    """Whether the kernels read these queries: at most `MAX_QUERIES`, and `mask` (bool `[batch, queries, columns]`) or
    None with a row per query."""
    return 1 <= n_queries <= MAX_QUERIES and (mask is None or mask.shape[1] == n_queries)


def query_strides(query: torch.Tensor, n_queries: int = 1) -> tuple[tuple[int, int, int, int], int]:
    """((batch, kv head, query head, query) strides, rows) of the queries the attention kernels read: `[batch,
    kv_heads, group, n_queries, dim]` (transformers' queries as a view, whatever their layout) or `[batch, kv_heads,
    rows, dim]` (row `g * n_queries + i`, rows contiguous); the channels contiguous either way."""
    if query.dim() == 5:
        return tuple(query.stride()[:4]), query.shape[2] * query.shape[3]
    row = query.stride(2)
    return (query.stride(0), query.stride(1), row * n_queries, row), query.shape[2]


def mask_strides(mask: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, query, column) strides of a mask `[batch, queries, columns]` (zeros without one)."""
    return (mask.stride(0), mask.stride(1), mask.stride(2)) if mask is not None else (0, 0, 0)


def log2_of(block: int) -> int:
    """Butterfly stages of a Hadamard block (`block` a power of two; 0 for no rotation)."""
    return max(int(block).bit_length() - 1, 0)


@triton.jit
def program(axis: tl.constexpr):
    """`tl.program_id(axis)` widened to int64: every offset computed from it is then summed in int64 (int32 products
    of program ids and strides wrap once a buffer passes 2**31 elements, e.g. 8 kv heads x 128 at batch 64 from ~33K
    tokens). Every kernel takes its program ids through this (a test reads the sources)."""
    return tl.program_id(axis).to(tl.int64)


@triton.jit
def step_state(state_ptr, sinks, pad, group, capacity):
    """A preallocated `DeltaKVCache` layer's device counters (`ops.TOKENS`, `CODED`, `OBSERVED`, `BEFORE`: int64) as a
    decoding step's kernels read them (`step.py`): the tokens held (at most `capacity`), the key groups coded, the
    positions observed, the position summed, and whether the newest token completed a key group (`ops
    .adaptive_attention`'s test: the stream's first group starts `pad` slots early)."""
    held = tl.minimum(tl.load(state_ptr), capacity)
    coded = tl.load(state_ptr + 1)
    stream = tl.maximum(held - sinks, 0)
    complete = (stream > 0) & ((pad + stream) % group == 0) & ((pad + stream) // group > coded)
    return held, coded, tl.load(state_ptr + 2), tl.load(state_ptr + 3), complete


@triton.jit
def spread(flag, like):
    """A scalar predicate `flag` as a mask of `like`'s shape (an integer block): the interpreter refuses a scalar
    bool broadcast into a block's mask, which a GPU takes."""
    return (like * 0 + tl.where(flag, 1, 0)) != 0


@triton.jit
def programs(axis: tl.constexpr):
    """`tl.num_programs(axis)` in int64 (see `program`)."""
    return tl.num_programs(axis).to(tl.int64)


@triton.jit
def butterflies(x, R: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr, SCALE: tl.constexpr):
    """`hadamard.rotate` of rows `x` fp32 `[R, D]`: stages h = 1, 2, ... 2**(STAGES - 1), each pair of channels
    `(i, i + h)` (bit h of i clear) to `(a + b, a - b)`, then times SCALE (`hadamard.rotation_scale`); the rows are
    first clamped to ±`hadamard.ROTATION_LIMIT` (NaN and ±inf kept) so that the sums of finite ones stay finite."""
    finite = tl.abs(x) != float("inf")  # (±inf kept: a non-finite input stays non-finite, as the reference's)
    x = tl.where(finite & (x > ROTATION_LIMIT), ROTATION_LIMIT, x)
    x = tl.where(finite & (x < -ROTATION_LIMIT), -ROTATION_LIMIT, x)
    for s in tl.static_range(STAGES):
        y = tl.permute(tl.reshape(x, (R, D // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))
    return x * SCALE


@triton.jit
def clamp(x, low, high):
    """`torch.clamp`: min(max(x, low), high) with NaN kept (`tl.minimum` / `tl.maximum` return the number where one
    side is NaN, on GPUs and in the interpreter alike)."""
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, low), high))


@triton.jit
def finite_or_zero(x):
    """`quant.blocks._finite_or_zero`: NaN and ±inf to 0 (a scaled value's code before clipping, as the reference)."""
    return tl.where((x == x) & (tl.abs(x) != float("inf")), x, 0.0)


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
def turn_rows(k, positions, freqs, T: tl.constexpr, D: tl.constexpr):
    """Rows `k` `[T, D]` stored before RoPE (canonical pairs `c, c + D/2`) turned by their int `positions` `[T]`
    (float64 `freqs` `[D/2]`, angles by `turned_cos_sin`)."""
    lo, hi = tl.split(tl.permute(tl.reshape(k, (T, 2, D // 2)), (0, 2, 1)))
    cos, sin = turned_cos_sin(positions[:, None], freqs[None, :])
    return tl.reshape(tl.permute(tl.join(lo * cos - hi * sin, hi * cos + lo * sin), (0, 2, 1)), (T, D))


@triton.jit
def snapshots_held(t, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, LAST: tl.constexpr,
                   INTERVAL: tl.constexpr):  # fmt: skip
    """`layout.SnapshotSchedule.count` of int `t` (any shape), for a schedule of three points."""
    early = (t >= P0).to(tl.int32) + (t >= P1).to(tl.int32) + (t >= P2).to(tl.int32)
    return tl.where(t < LAST, early, 4 + (t - LAST) // INTERVAL)


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
def query_rows_at(q_ptr, b, h, g, sqb, sqh, sqg, sqi, NQ):
    """Pointers `[len(g), 1]` to query rows `g` of kv head `h`: row `g` is query `g % NQ` of the kv head's query head
    `g // NQ` (`query_strides`)."""
    return q_ptr + b * sqb + h * sqh + ((g // NQ) * sqg + (g % NQ) * sqi)[:, None]


@triton.jit
def query_halves(q_ptr, b, h, sqb, sqh, sqg, sqi, lo_at, hi_at, g, GROUP, NQ):
    """fp32 `[len(g), D/2]` pair halves of query rows `g` of kv head `h` (of its `GROUP` rows: rows past them read
    zeros), channels `lo_at` and `hi_at` of each row (`c` and `c + D/2`, or a canonical order's)."""
    rows = query_rows_at(q_ptr, b, h, g, sqb, sqh, sqg, sqi, NQ)
    live = (g < GROUP)[:, None]
    lo = tl.load(rows + lo_at[None, :], mask=live, other=0.0).to(tl.float32)
    return lo, tl.load(rows + hi_at[None, :], mask=live, other=0.0).to(tl.float32)


@triton.jit
def visible(valid, column, query, b, mask_ptr, smb, smq, smt, causal_offset, MASK: tl.constexpr):
    """bool `[len(query), T]`: which of a tile's keys (mask columns `column`, `valid` `[T]`) each query row sees, row
    `r` being the forward's query `query[r]`: its row of the mask (`[batch, queries, columns]`), or, without one,
    every column up to its position (`causal_offset + query`: `reference.stream_attention`'s causal rule)."""
    if MASK:
        rows = mask_ptr + b * smb + query[:, None] * smq + column[None, :] * smt
        seen = tl.load(rows, mask=valid[None, :], other=0) != 0
    else:
        seen = column[None, :] <= causal_offset + query[:, None]
    return valid[None, :] & seen
