"""Triton kernels of a decoding step's bookkeeping, one launch each, writing into storage with room (no copy):

- `undo_rope_into`: new keys turned back by their RoPE, saturated to fp16, into the raw tail of the adaptive keys.
  Specification: `reference.undo_rope_into`.
- `quantize_at`: new tokens rotated (Hadamard butterflies) and quantized into their rows, in any format (q4_0,
  q4_1, q8_0, q3_0, f16 and the 16-wide variants; the symmetric ones with the searched scale when asked).
  Specification: `reference.quantize_at` (the same bytes).
- `add_query_energies`: a chunk's queries' pair energies averaged per kv head, each position's added to the
  encoder's running sum, the sums before the group starts it crosses and at its end kept (a new tensor).
  Specification: `reference.add_query_energies` (the same floats); over one position, `add_query_energy`
  (`reference.add_query_energy`).

A program handles a tile of up to `ROWS_MOST` tokens of a head (one on a decoding step; a prefill's rows in
tiles), or a kv head's queries; inputs are read in their own dtype and strides, so nothing is converted or copied
before the launch. The kernels launch with `common.EXACT` and follow the
references' operations in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Kind, QuantizedTensor, check_search_scale, get_format
from ...quant.blocks import SCALE_SEARCH
from ..hadamard import rotation_scale
from .common import (
    EXACT,
    FP16_MAX,
    butterflies,
    finite_or_zero,
    log2_of,
    on_device,
    program,
    rope_cos_sin,
    saturate_fp16,
    spread,
    step_state,
)
from .decode_attention import F16, Q3_SYM, Q4_ASYM, Q8, ROW_KINDS

ROWS_MOST = 16  # tokens a program of the append kernels handles (a prefill's; a decoding step has one)


def _rows(n: int) -> int:
    """Tokens per program for `n` new tokens: the power of two covering them, at most `ROWS_MOST`."""
    return min(triton.next_power_of_2(n), ROWS_MOST)


@triton.jit(do_not_specialize=("at", "n"))
def _undo_rope_kernel(
    k_ptr, pos_ptr, freq_ptr, order_ptr, out_ptr, state_ptr, ids_ptr, sink_ptr,
    heads, at, n, sinks, group, pad, capacity,
    skb, skh, skt, skd, spb, spt, sob, soh, sot, sib, ssb, ssh, sst,
    D: tl.constexpr, ROPE: tl.constexpr, ORDER: tl.constexpr, ROWS: tl.constexpr, STATE: tl.constexpr,
    IDS: tl.constexpr, SINK_F16: tl.constexpr,
):  # fmt: skip
    tile, bh = program(0), program(1)
    b, h = bh // heads, bh % heads
    half: tl.constexpr = D // 2
    c = tl.arange(0, half)[None, :]
    t = tile * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    live = t < n
    row = k_ptr + b * skb + h * skh + t * skt
    if STATE:  # a decoding step of a layer with device counters (`step.append_step`): its row and position on device
        held, coded, _, _, _ = step_state(state_ptr, sinks, pad, group, capacity)
        position = (tl.load(ids_ptr + b * sib) if IDS else held).to(tl.int32)
        room = held < capacity  # (past the capacity nothing is written; the host refuses the next step)
        tl.store(pos_ptr + b * spb + held * spt, position, mask=room & (h == 0))
        sink = room & (held < sinks)  # raw into the sinks, in the model's channel order (`ops.to_sinks`)
        for part in tl.static_range(2):
            x = tl.load(row + (c + part * half) * skd).to(tl.float32)
            x = saturate_fp16(x) if SINK_F16 else x
            tl.store(sink_ptr + b * ssb + h * ssh + held * sst + part * half + c, x, mask=spread(sink, c))
        at = held - sinks - tl.where(coded > 0, coded * group - pad, 0)
        live = live & spread(room & (held >= sinks), t)
    out = out_ptr + b * sob + h * soh + (at + t) * sot
    if ORDER:  # canonical channel c is the model's channel order[c]
        lo_at, hi_at = tl.load(order_ptr + c), tl.load(order_ptr + half + c)
    else:
        lo_at, hi_at = c, c + half
    lo = tl.load(row + lo_at * skd, mask=live, other=0.0).to(tl.float32)
    hi = tl.load(row + hi_at * skd, mask=live, other=0.0).to(tl.float32)
    if ROPE:  # rotate_pairs(x, cos, -sin)
        if STATE:
            cos, sin = rope_cos_sin(position, tl.load(freq_ptr + c))
        else:
            cos, sin = rope_cos_sin(tl.load(pos_ptr + b * spb + t * spt, mask=live, other=0), tl.load(freq_ptr + c))
        lo, hi = lo * cos + hi * sin, hi * cos - lo * sin
    tl.store(out + c, saturate_fp16(lo).to(tl.float16), mask=live)
    tl.store(out + half + c, saturate_fp16(hi).to(tl.float16), mask=live)


def undo_rope_into(
    keys: torch.Tensor,
    positions: torch.Tensor | None,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    target: torch.Tensor,
    at: int,
) -> None:
    """`reference.undo_rope_into` (see there); `freqs` float64 and `order` on the keys' device."""
    batch, heads, n, dim = keys.shape
    if not n:
        return
    rope = freqs is not None
    pos = positions if rope else keys
    rows = _rows(n)
    on_device(_undo_rope_kernel)[(triton.cdiv(n, rows), batch * heads)](
        keys, pos, freqs if rope else keys, order if order is not None else keys, target, keys, keys, keys,
        heads, at, n, 0, 1, 0, 0,
        *keys.stride(), pos.stride(0), pos.stride(-1), *target.stride()[:3], 0, 0, 0, 0,
        D=dim, ROPE=rope, ORDER=order is not None, ROWS=rows, STATE=False, IDS=False, SINK_F16=False, **EXACT,
    )  # fmt: skip


@triton.jit
def _symmetric_codes(x, peak, OFFSET: tl.constexpr, DIVISORS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    """`quant.blocks._quantize_symmetric` of blocks `x [nb, BS]`: unclipped-then-clipped fp32 codes and the fp32
    scale of the divisor with the least error (the first on ties; a NaN error never wins)."""
    best_codes = tl.zeros((NB, BS), tl.float32)
    best_scale = tl.zeros((NB,), tl.float32)
    best_error = tl.full((NB,), float("inf"), tl.float64)
    for i in tl.static_range(len(DIVISORS)):
        d = tl.math.div_rn(peak, -DIVISORS[i])
        d = tl.minimum(tl.maximum(d, -FP16_MAX), FP16_MAX)
        inv = tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))
        scaled = x * inv[:, None] + (OFFSET + 0.5)
        codes = finite_or_zero(tl.floor(scaled))
        codes = tl.minimum(tl.maximum(codes, 0.0), 2.0 * OFFSET - 1.0)
        if len(DIVISORS) == 1:
            best_codes, best_scale = codes, d
        else:
            stored = d.to(tl.float16).to(tl.float32)
            error = ((codes - OFFSET) * stored[:, None] - x).to(tl.float64)
            error = tl.sum(error * error, axis=1)
            if i == 0:
                best_codes, best_scale, best_error = codes, d, error
            else:
                better = error < best_error
                best_codes = tl.where(better[:, None], codes, best_codes)
                best_scale = tl.where(better, d, best_scale)
                best_error = tl.where(better, error, best_error)
    return best_codes, best_scale


@triton.jit
def _q8_0(x, magnitude, nan, NB: tl.constexpr):
    """q8_0's codes (int8) and fp32 scale of blocks `x` `[NB, 32]` (`magnitude`: |x|; `nan`: blocks holding a NaN,
    coded as zeros): absmax / 127, codes rounded half away from zero."""
    d = tl.minimum(tl.math.div_rn(tl.max(magnitude, axis=1), tl.full((NB,), 127.0, tl.float32)), FP16_MAX)
    inv = tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))
    scaled = x * inv[:, None]
    q = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(-scaled + 0.5))  # round half away from zero
    q = finite_or_zero(q)
    return tl.where(nan[:, None], 0.0, tl.minimum(tl.maximum(q, -127.0), 127.0)).to(tl.int8), d


@triton.jit
def q8_0_blocks(x, NB: tl.constexpr):
    """`quant.quantize(x, "q8_0")` of blocks `x` `[NB, 32]` fp32: int8 codes and fp16 scales (NaN for a block that is
    not all finite)."""
    magnitude = tl.abs(x)
    nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    finite = tl.sum(((x == x) & (magnitude != float("inf"))).to(tl.int32), axis=1) == 32
    q, d = _q8_0(x, magnitude, nan, NB)
    return q, tl.where(finite, d, float("nan")).to(tl.float16)


@triton.jit
def _finite_floor(scaled):
    """`_finite_or_zero(trunc(scaled))` for the non-negative or clipped-to-zero codes of the 4-bit formats."""
    return tl.where((scaled == scaled) & (tl.abs(scaled) != float("inf")), tl.floor(scaled), 0.0)


@triton.jit(do_not_specialize=("at", "n"))
def _quantize_rows_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, state_ptr, sink_ptr,
    heads, at, n, sinks, group, pad, capacity,
    sxb, sxh, sxt, sxd, scb, sch, sct, ssb, ssh, sst, skb, skh, skt,
    D: tl.constexpr, BS: tl.constexpr, KIND: tl.constexpr, STAGES: tl.constexpr, SCALE: tl.constexpr,
    DIVISORS: tl.constexpr, ROWS: tl.constexpr, STATE: tl.constexpr, SINK_F16: tl.constexpr,
):  # fmt: skip
    tile, bh = program(0), program(1)
    b, h = bh // heads, bh % heads
    if STATE:  # a decoding step of a layer with device counters (`step.append_step`): one token, its row on device
        held, _, _, _, _ = step_state(state_ptr, sinks, pad, group, capacity)
        room = held < capacity
        raw = tl.load(x_ptr + b * sxb + h * sxh + tl.arange(0, D) * sxd).to(tl.float32)
        raw = saturate_fp16(raw) if SINK_F16 else raw  # into the sinks raw (`ops.to_sinks`)
        e = tl.arange(0, D)
        tl.store(sink_ptr + b * skb + h * skh + held * skt + e, raw, mask=spread(room & (held < sinks), e))
        at = held - sinks
        n = tl.where(room & (held >= sinks), 1, 0)
    t = tile * ROWS + tl.arange(0, ROWS)[:, None]
    x = tl.load(x_ptr + b * sxb + h * sxh + t * sxt + tl.arange(0, D)[None, :] * sxd, mask=t < n, other=0.0)
    x = x.to(tl.float32)  # [ROWS, D]
    if STAGES > 0:
        x = butterflies(x, ROWS, D, STAGES, SCALE)
    if KIND == F16:  # finite values saturated, ±inf and NaN kept (`quant.quantize_f16`)
        finite_x = (x == x) & (tl.abs(x) != float("inf"))
        y = tl.where(finite_x, saturate_fp16(x), x)
        tl.store(codes_ptr + b * scb + h * sch + (at + t) * sct + tl.arange(0, D)[None, :], y.to(tl.float16),
                 mask=t < n)  # fmt: skip
    else:
        per_row: tl.constexpr = D // BS
        nb: tl.constexpr = ROWS * per_row  # the tile's blocks, row after row
        x = tl.reshape(x, (nb, BS))
        cols = tl.arange(0, BS)[None, :]
        magnitude = tl.abs(x)
        nan = tl.max((x != x).to(tl.int32), axis=1) > 0  # (tl.max need not propagate NaN as torch's does: codes 0)
        finite = tl.sum(((x == x) & (magnitude != float("inf"))).to(tl.int32), axis=1) == BS
        blocks = tl.arange(0, nb)
        token = tile * ROWS + blocks // per_row  # each block's token and its place in the token's row
        live = token < n
        row = b * scb + h * sch + (at + token) * sct
        if KIND == Q8:
            q, best_scale = _q8_0(x, magnitude, nan, nb)
            out = codes_ptr + row + (blocks % per_row) * BS
            tl.store(out[:, None] + cols, q, mask=live[:, None])
        elif KIND == Q4_ASYM:
            lo = tl.minimum(tl.maximum(tl.min(x, axis=1), -FP16_MAX), FP16_MAX)
            d = tl.math.div_rn(tl.max(x, axis=1) - lo, tl.full((nb,), 15.0, tl.float32))
            d = tl.minimum(tl.maximum(d, -FP16_MAX), FP16_MAX)
            inv = tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))
            codes = tl.minimum(tl.maximum(_finite_floor((x - lo[:, None]) * inv[:, None] + 0.5), 0.0), 15.0)
            tl.store(mins_ptr + b * ssb + h * ssh + (at + token) * sst + blocks % per_row,
                     tl.where(finite, lo, float("nan")).to(tl.float16), mask=live)  # fmt: skip
            best_scale = d
        else:
            first = tl.min(tl.where(magnitude == tl.max(magnitude, axis=1)[:, None], cols, BS), axis=1)  # torch.argmax
            peak = tl.sum(tl.where(cols == first[:, None], x, 0.0), axis=1)
            codes, best_scale = _symmetric_codes(x, peak, 4 if KIND == Q3_SYM else 8, DIVISORS, nb, BS)
        if KIND == Q3_SYM:  # `pack_3bit`: 2 low bits of codes j, j + 8, j + 16, j + 24 in byte j; high bits in 8-11
            c = tl.reshape(tl.where(nan[:, None], 0.0, codes).to(tl.int32), (nb, 4, 8))
            shift = tl.arange(0, 4)[None, :, None]
            low = tl.sum((c & 3) << (2 * shift), axis=1)  # [nb, 8]
            high = tl.sum((c >> 2) << tl.arange(0, 8)[None, None, :], axis=2)  # [nb, 4]
            out = codes_ptr + row + (blocks % per_row) * 12
            tl.store(out[:, None] + tl.arange(0, 8)[None, :], low.to(tl.uint8), mask=live[:, None])
            tl.store(out[:, None] + 8 + tl.arange(0, 4)[None, :], high.to(tl.uint8), mask=live[:, None])
        elif KIND != Q8:  # 4-bit: byte j holds code j (low nibble) and code j + BS/2 (high)
            codes = tl.where(nan[:, None], 0.0, codes).to(tl.uint8)
            low, high = tl.split(tl.permute(tl.reshape(codes, (nb, 2, BS // 2)), (0, 2, 1)))
            out = codes_ptr + row + (blocks % per_row) * (BS // 2)
            tl.store(out[:, None] + tl.arange(0, BS // 2)[None, :], low | (high << 4), mask=live[:, None])
        scale = tl.where(finite, best_scale, float("nan")).to(tl.float16)
        tl.store(scales_ptr + b * ssb + h * ssh + (at + token) * sst + blocks % per_row, scale, mask=live)


def serves_quantize(fmt: str, dim: int) -> bool:
    """Every format (`decode_attention.ROW_KINDS`) over rows of a power-of-two width tiled by its blocks: what
    `quantize_at` codes (rotated or not, searched or not)."""
    block = get_format(fmt).block_size
    return get_format(fmt).kind in ROW_KINDS and dim % block == 0 and dim >= max(block, 2) and not dim & (dim - 1)


def quantize_at(
    x: torch.Tensor, fmt: str, search_scale: bool, target: QuantizedTensor, at: int, rotation: int = 0
) -> None:
    """`reference.quantize_at` (see there) for the formats of `serves_quantize`."""
    batch, heads, n, dim = x.shape
    form = check_search_scale(fmt, search_scale)
    if not n:
        return
    codes = target.codes.view(torch.int8) if form.kind == Kind.Q8 else target.codes
    scales = target.scales if target.scales is not None else codes  # (f16: no scales)
    mins = target.mins if target.mins is not None else scales
    rows = _rows(n)
    on_device(_quantize_rows_kernel)[(triton.cdiv(n, rows), batch * heads)](
        x, codes, scales, mins, x, x,
        heads, at, n, 0, 1, 0, 0,
        *x.stride(), *codes.stride()[:3], *scales.stride()[:3], 0, 0, 0,
        **_quantize_constants(form, dim, rotation, search_scale), ROWS=rows, STATE=False, SINK_F16=False, **EXACT,
    )  # fmt: skip


def _quantize_constants(form, dim: int, rotation: int, search_scale: bool) -> dict:
    """The constants `_quantize_rows_kernel` codes `form` with (rows of `dim`, Hadamard blocks of `rotation`)."""
    divisors = SCALE_SEARCH[4 if form.kind == Kind.Q3_SYM else 8]
    return dict(D=dim, BS=form.block_size, KIND=int(form.kind), STAGES=log2_of(rotation),
                SCALE=rotation_scale(rotation) if rotation else 1.0,
                DIVISORS=tuple(float(d) for d in (divisors if search_scale else divisors[:1])))  # fmt: skip


@triton.jit
def _mean_energy(rows, sqg, sqd, lo_at, hi_at, GROUP: tl.constexpr):
    """`reference.query_energy` of one position: the pair energies of its `GROUP` query rows (from `rows`, `sqg`
    apart) averaged, `[D/2]` fp32, added in order as the reference adds its heads."""
    energy = tl.zeros(lo_at.shape, tl.float32)
    for g in tl.static_range(GROUP):
        lo = tl.load(rows + g * sqg + lo_at * sqd).to(tl.float32)
        hi = tl.load(rows + g * sqg + hi_at * sqd).to(tl.float32)
        pair = (lo * lo + hi * hi) * 0.5  # (halving is exact: the reference's / 2)
        if g == 0:
            energy = pair
        else:
            energy = energy + pair
    return tl.math.div_rn(energy, tl.full(lo_at.shape, GROUP, tl.float32))


def add_query_energy(
    query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, total: torch.Tensor | None
) -> torch.Tensor:
    """`reference.add_query_energy` (see there); `order` on the queries' device, `total` contiguous: the chunk's
    kernel over one position (`0 + e == e` exactly)."""
    batch, heads, rows, dim = query.shape
    grouped = query.reshape(batch, kv_heads, heads * rows // kv_heads, 1, dim)  # a view for both transformers layouts
    out = torch.empty(batch, kv_heads, 1, dim, dtype=torch.float32, device=query.device)
    on_device(_query_energies_kernel)[(batch * kv_heads,)](
        grouped, order if order is not None else grouped, total if total is not None else out, out, out, out,
        kv_heads, 1, 0, 1, 1, 0, 0, 0, 0, *grouped.stride(),
        GROUP=grouped.shape[2], D=dim, ORDER=order is not None, TOTAL=total is not None, STATE=False, **EXACT,
    )  # fmt: skip
    return out[:, :, 0]


@triton.jit(do_not_specialize=("n", "first", "kept"))
def _query_energies_kernel(
    q_ptr, order_ptr, total_ptr, out_ptr, state_ptr, before_ptr,
    kv_heads, n, first, group, kept, sinks, pad, capacity, lead, sqb, sqh, sqg, sqn, sqd,
    GROUP: tl.constexpr, D: tl.constexpr, ORDER: tl.constexpr, TOTAL: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    bh = program(0)
    b, h = bh // kv_heads, bh % kv_heads
    half: tl.constexpr = D // 2
    c = tl.arange(0, half)
    if ORDER:
        lo_at, hi_at = tl.load(order_ptr + c), tl.load(order_ptr + half + c)
    else:
        lo_at, hi_at = c, c + half
    lower = tl.zeros((half,), tl.float32)  # (0 + e == e exactly: the reference's first sum without a total)
    upper = tl.zeros((half,), tl.float32)
    if STATE:  # a decoding step with device counters (`step.attention_step`): `ops.adaptive_attention`'s tests
        held, coded, observed, _, complete = step_state(state_ptr, sinks, pad, group, capacity)
        new = held - 1 >= observed  # (a position is observed once)
        keep = new & (held % group == 0) & (held // group >= coded + complete.to(tl.int64) + lead)
        lower = tl.load(total_ptr + bh * D + c, mask=spread(observed > 0, c), other=0.0)
        upper = tl.load(total_ptr + bh * D + half + c, mask=spread(observed > 0, c), other=0.0)
        energy = _mean_energy(q_ptr + b * sqb + h * sqh, sqg, sqd, lo_at, hi_at, GROUP)
        lower, upper = lower + energy, upper + energy
        new, keep = spread(new, c), spread(keep, c)
        tl.store(out_ptr + bh * D + c, lower, mask=new)  # the running sum
        tl.store(out_ptr + bh * D + half + c, upper, mask=new)
        tl.store(before_ptr + bh * D + c, lower, mask=keep)  # the sum the next group's depths are placed by
        tl.store(before_ptr + bh * D + half + c, upper, mask=keep)
        return
    if TOTAL:
        lower = tl.load(total_ptr + bh * D + c)
        upper = tl.load(total_ptr + bh * D + half + c)
    k = 0
    for j in range(n):  # the positions in order, each one's mean over the query heads added to the running sum
        energy = _mean_energy(q_ptr + b * sqb + h * sqh + j * sqn, sqg, sqd, lo_at, hi_at, GROUP)
        lower = lower + energy
        upper = upper + energy
        if (j == n - 1) | ((first + j + 1) % group == 0):  # before a group start, or the whole chunk's
            tl.store(out_ptr + (bh * kept + k) * D + c, lower)
            tl.store(out_ptr + (bh * kept + k) * D + half + c, upper)
            k += 1


def add_query_energies(
    query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, total: torch.Tensor | None, first: int,
    group: int,
) -> torch.Tensor:  # fmt: skip
    """`reference.add_query_energies` (see there) in one launch; `query` `[batch, q_heads, n, dim]` (any strides),
    `order` on its device, `total` contiguous."""
    from ..reference import group_starts

    batch, heads, n, dim = query.shape
    grouped = query.unflatten(1, (kv_heads, heads // kv_heads))  # [B, kv heads, group, n, D]: a view
    kept = len(group_starts(first, n, group)) + 1
    out = torch.empty(batch, kv_heads, kept, dim, dtype=torch.float32, device=query.device)
    on_device(_query_energies_kernel)[(batch * kv_heads,)](
        grouped, order if order is not None else grouped, total if total is not None else out, out, out, out,
        kv_heads, n, first, group, kept, 0, 0, 0, 0, *grouped.stride(),
        GROUP=heads // kv_heads, D=dim, ORDER=order is not None, TOTAL=total is not None, STATE=False, **EXACT,
    )  # fmt: skip
    return out
