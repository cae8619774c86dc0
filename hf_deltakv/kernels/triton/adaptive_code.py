"""Triton kernel: the adaptive keys' coding of complete groups, one program per (batch, kv head, group), written
straight into the rows of the stream's storage. Specification: `reference.code_groups` (`encode_groups`).

A program loads its group's raw fp16 tokens `[group, D]` and, in registers: each channel's range and score (range
squared times the queries' mean pair energy), the depths (`reference.allocate_bits`: the level transform, the
water level's bisection with its sums in float64, the leftover bits by a stable ranking of the fractions), the
clipped range of `reference.CLIPS` that codes the channel with the least squared error, the codes, and their bit
planes (each channel's planes after those of the channels before it: an exclusive prefix sum of the depths).
Launched with `common.EXACT`: every step is the reference's fp32 (or float64) operation, so the bytes agree with
it; the one exception is the sum of a candidate's squared errors over the group's tokens, which the reference adds
in torch's order and the kernel as a tree (a candidate whose error ties another's to the last bit may be chosen
differently: the same error, another range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant.bitplanes import MAX_BITS
from ..reference import CLIP_KEEP, CLIP_LOW, CLIPS, WATER_LEVEL_STEPS
from .common import EXACT, FP16_MAX, clamp, on_device, program, round_half_even, step_state

FLT_MAX = tl.constexpr(float(torch.finfo(torch.float32).max))


@triton.jit
def _stable_rank(value, idx, D: tl.constexpr):
    """Each entry's place in a stable descending order of `value` [D] (ties: the lower index first)."""
    rank = tl.zeros((D,), tl.int32)
    for j in range(D):
        other = tl.sum(tl.where(idx == j, value, 0.0))
        rank += ((other > value) | ((other == value) & (j < idx))).to(tl.int32)
    return rank


@triton.jit
def _pick(values: tl.constexpr, i):
    """`values[i]` (a tuple of six fp32 numbers) for a runtime index `i`."""
    return tl.where(
        i == 0,
        values[0],
        tl.where(
            i == 1,
            values[1],
            tl.where(i == 2, values[2], tl.where(i == 3, values[3], tl.where(i == 4, values[4], values[5]))),
        ),
    )


@triton.jit
def _grid_codes(x, low, inverse, top):
    """`reference._grid_codes`: round((x - low) * inverse), NaN to 0, clamped to 0..top (fp32)."""
    codes = round_half_even((x - low[None, :]) * inverse[None, :])
    codes = tl.where(codes != codes, 0.0, codes)
    return tl.minimum(tl.maximum(codes, 0.0), top[None, :])


@triton.jit(do_not_specialize=("pad", "at"))
def _code_groups_kernel(
    tail_ptr, w_ptr, planes_ptr, depths_ptr, low_ptr, step_ptr, state_ptr,
    heads, pad, total, at, sinks, capacity,
    stb, sth, stt, std, swb, swh, swg, spb, sph, spr, sdb, sdh, sdr, slb, slh, slr, ssb, ssh, ssr,
    GS: tl.constexpr, D: tl.constexpr, WEIGHTS: tl.constexpr, NCAND: tl.constexpr,
    CLIP_LOW: tl.constexpr, CLIP_KEEP: tl.constexpr, STEPS: tl.constexpr, MOST: tl.constexpr, STATE: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):  # fmt: skip
    g, bh = program(0), program(1)  # (groups on axis 0: no 65,535 limit)
    b, h = bh // heads, bh % heads
    half: tl.constexpr = D // 2
    c = tl.arange(0, D)
    slot = tl.arange(0, GS)
    written = True
    if STATE:  # a decoding step with device counters (`step.attention_step`): the group its token completed, if any
        _held, coded, _observed, summed, written = step_state(state_ptr, sinks, pad, GS, capacity)  # (`_` is a loop's)
        pad = tl.where(coded > 0, 0, pad)  # (the first group starts `pad` slots early, the later ones at row 0)
        at = coded
    if written:  # (with STATE: only on the step that completed a group)
        row = tl.maximum(g * GS + slot - pad, 0)  # the sink slots before the stream repeat its first token
        x = tl.load(tail_ptr + b * stb + h * sth + row[:, None] * stt + c[None, :] * std).to(tl.float32)  # [GS, D]
        nan = tl.max((x != x).to(tl.int32), axis=0) > 0
        low = tl.where(nan, float("nan"), tl.min(x, axis=0))
        span = tl.where(nan, float("nan"), tl.max(x, axis=0)) - low
        score = span * span
        if STATE:  # the queries' energies summed before the group (`ops.adaptive_attention`: before / summed), if any,
            # divided as torch divides by a host number on the device at hand (CUDA: times the reciprocal)
            count = tl.maximum(summed, 1).to(tl.float32)
            summed_energy = tl.load(w_ptr + b * swb + h * swh + c)
            if RECIPROCAL:
                weight = summed_energy * tl.math.div_rn(1.0, count)
            else:
                weight = tl.math.div_rn(summed_energy, count)
            score = tl.where(summed > 0, score * weight, score)
        elif WEIGHTS:
            score = score * tl.load(w_ptr + b * swb + h * swh + g * swg + c)
        # reference.allocate_bits: the level of every channel (the least for dead ones)
        finite = (score == score) & (tl.abs(score) != float("inf")) & (score > 0)
        level = tl.log2(tl.where(finite, score, 1.0)) * 0.5
        lowest = tl.minimum(tl.min(tl.where(finite, level, float("inf")), axis=0), 0.0) - 2 * MOST
        level = tl.where(finite, level, lowest)
        # reference.allocate_depths: bisection of the water level, sums in float64
        below = -4.0 * MOST - tl.max(level, axis=0)
        above = 4.0 * MOST - tl.min(level, axis=0)
        for _ in range(STEPS):
            middle = (below + above) * 0.5  # (halving is exact: the reference's / 2)
            spent = tl.sum(tl.minimum(tl.maximum(level + middle, 1.0), MOST * 1.0).to(tl.float64), axis=0)
            short = spent < total
            below = tl.where(short, middle, below)
            above = tl.where(short, above, middle)
        depth = tl.minimum(tl.maximum(level + above, 1.0), MOST * 1.0)
        base = tl.floor(depth)
        left = tl.maximum(total - tl.sum(base, axis=0), 0.0)
        fraction = tl.where(base >= MOST, -1.0, depth - base)
        bits = base + (_stable_rank(fraction, c, D).to(tl.float32) < left).to(tl.float32)
        excess = tl.sum(bits, axis=0) - total
        if excess > 0:  # float edge cases: bits taken back from the largest depths
            bits = bits - (_stable_rank(bits, c, D).to(tl.float32) < excess).to(tl.float32)
        depths = bits.to(tl.int32)
        top = ((1 << depths) - 1).to(tl.float32)
        # reference.clipped_codes: each channel's best candidate range
        best_error = tl.full((D,), float("inf"), tl.float32)
        best_low = tl.zeros((D,), tl.float32)
        best_step = tl.zeros((D,), tl.float32)
        for i in range(NCAND):  # (a loop, not unrolled: each candidate's tiles live one at a time)
            lows = clamp(low + _pick(CLIP_LOW, i // 6) * span, -FP16_MAX, FP16_MAX)  # (NaN kept, as torch.clamp)
            lows = lows.to(tl.float16).to(tl.float32)
            highs = low + span * _pick(CLIP_KEEP, i % 6)
            steps = tl.math.div_rn(highs - lows, top)
            steps = clamp(steps, 0.0, FP16_MAX).to(tl.float16).to(tl.float32)
            inverse = tl.where(steps > 0, tl.math.div_rn(1.0, tl.where(steps > 0, steps, 1.0)), 0.0)
            error = _grid_codes(x, lows, inverse, top) * steps[None, :] + lows[None, :] - x
            error = tl.sum(error * error, axis=0)
            error = tl.where(error != error, float("inf"), tl.where(error == float("inf"), FLT_MAX, error))
            better = (error < best_error) | (i == 0)  # argmin: the first candidate on ties
            best_error = tl.where(better, error, best_error)
            best_low = tl.where(better, lows, best_low)
            best_step = tl.where(better, steps, best_step)
        inverse = tl.where(best_step > 0, tl.math.div_rn(1.0, tl.where(best_step > 0, best_step, 1.0)), 0.0)
        codes = _grid_codes(x, best_low, inverse, top).to(tl.int32)  # [GS, D]
        # bit planes: plane k of channel c at (offset of c) + k, bit j of its byte i is token 8 i + j
        first_plane = tl.cumsum(depths, axis=0) - depths
        byte = tl.arange(0, GS // 8)
        weight = (1 << tl.arange(0, 8))[None, :, None]
        planes = planes_ptr + b * spb + h * sph + (at + g) * spr
        for k in tl.static_range(MOST):
            plane = tl.sum(tl.reshape((codes >> k) & 1, (GS // 8, 8, D)) * weight, axis=1)  # [GS / 8, D]
            where = planes + (first_plane + k)[None, :] * (GS // 8) + byte[:, None]
            tl.store(where, plane.to(tl.uint8), mask=(k < depths)[None, :])
        lo_depth, hi_depth = tl.split(tl.permute(tl.reshape(depths, (2, half)), (1, 0)))
        packed = (lo_depth | (hi_depth << 4)).to(tl.uint8)
        tl.store(depths_ptr + b * sdb + h * sdh + (at + g) * sdr + tl.arange(0, half), packed)
        tl.store(low_ptr + b * slb + h * slh + (at + g) * slr + c, best_low.to(tl.float16))
        tl.store(step_ptr + b * ssb + h * ssh + (at + g) * ssr + c, best_step.to(tl.float16))


def serves(dim: int, group: int) -> bool:
    """Power-of-two head dims (Triton's blocks) and groups of a whole number of plane bytes."""
    return dim >= 2 and not dim & (dim - 1) and group % 8 == 0


def code_groups(
    tail: torch.Tensor,
    pad: int,
    groups: int,
    weights: torch.Tensor | None,
    total: int,
    clip_range: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    at: int,
) -> None:
    """`reference.code_groups` (see there); each of `out`'s rows contiguous past its sequence dimension."""
    planes, depths, low, step = out
    batch, heads, _, dim = tail.shape
    group = planes.shape[-1] * 8
    w = weights if weights is not None else tail
    on_device(_code_groups_kernel)[(groups, batch * heads)](
        tail, w, planes, depths, low, step, tail,
        heads, pad, total, at, 0, 0,
        *tail.stride(), *w.stride()[:3], *planes.stride()[:3], *depths.stride()[:3], *low.stride()[:3],
        *step.stride()[:3],
        **code_constants(group, dim, clip_range), WEIGHTS=weights is not None, STATE=False, RECIPROCAL=False, **EXACT,
    )  # fmt: skip


def code_constants(group: int, dim: int, clip_range: bool) -> dict:
    """The constants (and warps) `_code_groups_kernel` codes groups of `group` tokens of `dim` channels with (launched
    with `common.EXACT` besides)."""
    return dict(GS=group, D=dim, NCAND=len(CLIPS) if clip_range else 1, CLIP_LOW=CLIP_LOW, CLIP_KEEP=CLIP_KEEP,
                STEPS=WATER_LEVEL_STEPS, MOST=MAX_BITS, num_warps=4 if dim * group <= 2048 else 8)  # fmt: skip
