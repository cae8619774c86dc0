"""Triton kernels: closed-loop delta encoding of `DeltaCodec`, whole keyframe groups (a prefill's:
`_delta_encode_kernel`, specification `reference.delta_encode_groups`) and a decoding step's tokens written into the
storage's room (`_delta_tokens_kernel`, specification `reference.delta_tokens`: one program per stream walks the 1-64
new tokens, RoPE undone, rotated, keyframe or delta, the running mean and its snapshots carried in registers).

In the group kernel one program codes one keyframe group of one stream: starting from the keyframe's reconstruction,
each later token of the group is coded as a 4-bit (q4_0 arithmetic, blocks of `2 * HALF` channels) delta from the
previous token's *reconstruction*; with `INTRA`, each block is instead coded against the long-term reference when
that reconstructs it better, the choice carried in the lowest mantissa bit of the block's fp16 scale (`code_step`,
both kernels). The loop over tokens is sequential (closed loop); streams and groups run in parallel. A block is held
as its two halves, because byte j of a block packs code j (low nibble) with code j + HALF (high nibble), llama.cpp's
order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hadamard import rotation_scale
from ..layout import DeltaRows
from .append import q8_0_blocks
from .common import (
    EXACT,
    butterflies,
    finite_or_zero,
    log2_of,
    on_device,
    program,
    rope_cos_sin,
    saturate_fp16,
    snapshots_held,
)
from .quantize import q4_0_halves


@triton.jit
def _code_against(x_lo, x_hi, base_lo, base_hi, cols, HALF: tl.constexpr):
    """q4_0 of `x - base` (blocks as halves): clipped codes, fp16 scale and the reconstruction from that scale."""
    q_lo, q_hi, d = q4_0_halves(x_lo - base_lo, x_hi - base_hi, cols, HALF)
    q_lo = tl.minimum(tl.maximum(finite_or_zero(q_lo), 0.0), 15.0)  # (an infinite element codes 0, as the reference)
    q_hi = tl.minimum(tl.maximum(finite_or_zero(q_hi), 0.0), 15.0)
    scale = d.to(tl.float16)
    step = scale.to(tl.float32)[:, None]
    return q_lo, q_hi, scale, base_lo + (q_lo - 8.0) * step, base_hi + (q_hi - 8.0) * step


@triton.jit
def _sse(r_lo, r_hi, x_lo, x_hi):
    return tl.sum((r_lo - x_lo) * (r_lo - x_lo), axis=1) + tl.sum((r_hi - x_hi) * (r_hi - x_hi), axis=1)


@triton.jit
def code_step(x_lo, x_hi, rec_lo, rec_hi, l_lo, l_hi, cols, HALF: tl.constexpr, INTRA: tl.constexpr):
    """One closed-loop step (`reference.code_delta`, q4_0 arithmetic): blocks of `x` (as halves `[NB, HALF]`) coded
    against the previous reconstruction `rec`, or with `INTRA`, blockwise, against the long-term reference `l` where
    that reconstructs them better, the choice in the scale's lowest mantissa bit. Returns the codes of each half, the
    (flagged) fp16 scales and the new reconstruction."""
    q_lo, q_hi, scale, new_lo, new_hi = _code_against(x_lo, x_hi, rec_lo, rec_hi, cols, HALF)
    if INTRA:
        i_lo, i_hi, i_scale, r_lo, r_hi = _code_against(x_lo, x_hi, l_lo, l_hi, cols, HALF)
        use_intra = _sse(r_lo, r_hi, x_lo, x_hi) < _sse(new_lo, new_hi, x_lo, x_hi)
        q_lo = tl.where(use_intra[:, None], i_lo, q_lo)
        q_hi = tl.where(use_intra[:, None], i_hi, q_hi)
        scale = tl.where(use_intra, i_scale, scale)
        # the flag rides in the scale's lowest mantissa bit; the decoder reads the flagged scale, so we do too
        bits = (scale.to(tl.int16, bitcast=True) & -2) | use_intra.to(tl.int16)
        scale = bits.to(tl.float16, bitcast=True)
        step = scale.to(tl.float32)[:, None]
        base_lo = tl.where(use_intra[:, None], l_lo, rec_lo)
        base_hi = tl.where(use_intra[:, None], l_hi, rec_hi)
        new_lo = base_lo + (q_lo - 8.0) * step
        new_hi = base_hi + (q_hi - 8.0) * step
    return q_lo, q_hi, scale, new_lo, new_hi


@triton.jit
def _delta_encode_kernel(
    x_ptr,
    long_ptr,
    key_ptr,
    codes_ptr,
    scales_ptr,
    recon_ptr,
    kf,
    NB: tl.constexpr,
    HALF: tl.constexpr,
    INTRA: tl.constexpr,
):
    group = program(0)  # stream * groups + group: the row layout of x `[S, G, kf, D]`
    dim = NB * 2 * HALF
    blocks = tl.arange(0, NB)
    cols = tl.arange(0, HALF)
    lo_at = blocks[:, None] * 2 * HALF + cols[None, :]
    hi_at = lo_at + HALF
    rec_lo = tl.load(key_ptr + group * dim + lo_at)
    rec_hi = tl.load(key_ptr + group * dim + hi_at)
    tl.store(recon_ptr + group * kf * dim + lo_at, rec_lo)
    tl.store(recon_ptr + group * kf * dim + hi_at, rec_hi)
    for offset in range(1, kf):
        token = (group * kf + offset) * dim
        x_lo = tl.load(x_ptr + token + lo_at)
        x_hi = tl.load(x_ptr + token + hi_at)
        l_lo = tl.load(long_ptr + token + lo_at) if INTRA else x_lo
        l_hi = tl.load(long_ptr + token + hi_at) if INTRA else x_hi
        q_lo, q_hi, scale, new_lo, new_hi = code_step(x_lo, x_hi, rec_lo, rec_hi, l_lo, l_hi, cols, HALF, INTRA)
        rec_lo = new_lo
        rec_hi = new_hi
        tl.store(recon_ptr + token + lo_at, rec_lo)
        tl.store(recon_ptr + token + hi_at, rec_hi)
        row = group * (kf - 1) + offset - 1
        tl.store(scales_ptr + row * NB + blocks, scale)
        packed = q_lo.to(tl.uint8) | (q_hi.to(tl.uint8) << 4)
        tl.store(codes_ptr + row * NB * HALF + blocks[:, None] * HALF + cols[None, :], packed)


def delta_encode_groups(
    x: torch.Tensor, long_term: torch.Tensor | None, keyframes: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of `reference.delta_encode_groups` (fp32; `dim` a multiple of `block`, `dim / block` a power
    of two)."""
    streams, groups, kf, dim = x.shape
    if dim % block or (dim // block) & (dim // block - 1) or block % 2:
        raise ValueError(f"the delta encode kernel needs dim / block a power of two, got dim {dim}, block {block}")
    nb = dim // block
    codes = torch.empty(streams, groups, kf - 1, nb, block // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(streams, groups, kf - 1, nb, dtype=torch.float16, device=x.device)
    recon = torch.empty(streams, groups, kf, dim, dtype=torch.float32, device=x.device)
    intra = long_term is not None
    long_term = (long_term if intra else x).contiguous()
    if streams * groups:
        on_device(_delta_encode_kernel)[(streams * groups,)](
            x.contiguous(),
            long_term,
            keyframes.contiguous(),
            codes,
            scales,
            recon,
            kf,
            NB=nb,
            HALF=block // 2,
            INTRA=intra,
            **EXACT,
        )
    return codes, scales, recon


@triton.jit(do_not_specialize=("n", "start", "key_at", "delta_at", "mean_at"))
def _delta_tokens_kernel(
    x_ptr, pos_ptr, freq_ptr, order_ptr, ref_ptr, sum_ptr, long_ptr, kc_ptr, ks_ptr, dc_ptr, ds_ptr, mean_ptr,
    ref_out, sum_out,
    heads, n, start, key_at, delta_at, mean_at,
    sxb, sxh, sxt, sxd, spb, spt, slb, slh, skb, skh, skt, sgb, sgh, sgt, sdb, sdh, sdt, seb, seh, set_, snb, snh, sns,
    D: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr, ORDER: tl.constexpr, STAGES: tl.constexpr,
    SCALE: tl.constexpr, KF: tl.constexpr, PREVIOUS: tl.constexpr, INTRA: tl.constexpr, LONG: tl.constexpr,
    SUM: tl.constexpr, DELTAS: tl.constexpr, MEANS: tl.constexpr, SNAP_0: tl.constexpr, SNAP_1: tl.constexpr,
    SNAP_2: tl.constexpr, SNAP_LAST: tl.constexpr, SNAP_INTERVAL: tl.constexpr,
):  # fmt: skip
    bh = program(0)
    b, h = bh // heads, bh % heads
    half: tl.constexpr = D // 2
    nb: tl.constexpr = D // (2 * HALF)
    c = tl.arange(0, half)
    e = tl.arange(0, D)
    cols = tl.arange(0, HALF)
    blocks = tl.arange(0, nb)
    if ORDER:  # the model's channel order: pairs read from where the model keeps them
        lo_at, hi_at = tl.load(order_ptr + c), tl.load(order_ptr + half + c)
    else:
        lo_at, hi_at = c, c + half
    freqs = tl.load(freq_ptr + c) if ROPE else tl.zeros((half,), tl.float64)
    base = tl.load(ref_ptr + bh * D + e)  # what the next delta is coded from
    total = tl.load(sum_ptr + bh * D + e) if SUM else tl.zeros((D,), tl.float32)
    if LONG:  # the newest mean snapshot
        long = tl.load(long_ptr + b * slb + h * slh + e).to(tl.float32)
    else:
        long = tl.zeros((D,), tl.float32)
    held_before = snapshots_held(start, SNAP_0, SNAP_1, SNAP_2, SNAP_LAST, SNAP_INTERVAL)
    for i in range(n):  # the closed loop: one token after the other
        held = start + i
        key = x_ptr + b * sxb + h * sxh + i * sxt
        if ROPE:  # turned back by its RoPE into the canonical order (`reference.undo_rope`)
            lo = tl.load(key + lo_at * sxd).to(tl.float32)
            hi = tl.load(key + hi_at * sxd).to(tl.float32)
            cos, sin = rope_cos_sin(tl.load(pos_ptr + b * spb + i * spt), freqs)
            lo, hi = lo * cos + hi * sin, hi * cos - lo * sin
            x = tl.reshape(tl.permute(tl.join(lo, hi), (1, 0)), (1, D))
        else:
            x = tl.load(key + e * sxd).to(tl.float32)[None, :]
        if STAGES > 0:  # `hadamard.rotate`
            x = butterflies(x, 1, D, STAGES, SCALE)
        x = tl.reshape(x, (D,))
        key_lanes = (e * 0 + held) % KF == 0  # (conditions as vectors: the interpreter's scalar masks misbehave)
        keys_before = (held + KF - 1) // KF - (start + KF - 1) // KF  # keyframes among the new tokens before it
        # a keyframe: q8_0 (`quant.blocks`), and what the decoder reconstructs from it
        codes, scale = q8_0_blocks(tl.reshape(x, (D // 32, 32)), D // 32)
        key_row = key_at + keys_before
        tl.store(kc_ptr + b * skb + h * skh + key_row * skt + e, tl.reshape(codes, (D,)), mask=key_lanes)
        key_blocks = tl.arange(0, D // 32)
        tl.store(ks_ptr + b * sgb + h * sgh + key_row * sgt + key_blocks, scale, mask=(key_blocks * 0 + held) % KF == 0)
        recon = tl.reshape(codes.to(tl.float32) * scale.to(tl.float32)[:, None], (D,))
        if DELTAS:  # else: a delta from `base`, or intra from the long-term reference (`reference.code_delta`)
            x_lo, x_hi = tl.split(tl.permute(tl.reshape(x, (nb, 2, HALF)), (0, 2, 1)))
            rec_lo, rec_hi = tl.split(tl.permute(tl.reshape(base, (nb, 2, HALF)), (0, 2, 1)))
            l_lo, l_hi = tl.split(tl.permute(tl.reshape(long, (nb, 2, HALF)), (0, 2, 1)))
            q_lo, q_hi, step, new_lo, new_hi = code_step(x_lo, x_hi, rec_lo, rec_hi, l_lo, l_hi, cols, HALF, INTRA)
            delta_row = delta_at + i - keys_before
            packed = q_lo.to(tl.uint8) | (q_hi.to(tl.uint8) << 4)
            byte = blocks[:, None] * HALF + cols[None, :]
            tl.store(dc_ptr + b * sdb + h * sdh + delta_row * sdt + byte, packed, mask=(byte * 0 + held) % KF != 0)
            tl.store(ds_ptr + b * seb + h * seh + delta_row * set_ + blocks, step, mask=(blocks * 0 + held) % KF != 0)
            recon = tl.where(key_lanes, recon, tl.reshape(tl.permute(tl.join(new_lo, new_hi), (0, 2, 1)), (D,)))
        if PREVIOUS:
            base = recon
        else:  # deltas from the group's keyframe
            base = tl.where(key_lanes, recon, base)
        total = total + x
        if MEANS:  # a mean snapshot due once the stream holds this token: the mean so far, saturated to fp16
            after = snapshots_held(held + 1, SNAP_0, SNAP_1, SNAP_2, SNAP_LAST, SNAP_INTERVAL)
            due = e * 0 + after > snapshots_held(held, SNAP_0, SNAP_1, SNAP_2, SNAP_LAST, SNAP_INTERVAL)
            mean = saturate_fp16(tl.math.div_rn(total, tl.full((D,), 1.0, tl.float32) * (held + 1))).to(tl.float16)
            row = mean_at + after - held_before - 1
            tl.store(mean_ptr + b * snb + h * snh + row * sns + e, mean, mask=due)
            long = tl.where(due, mean.to(tl.float32), long)
    tl.store(ref_out + bh * D + e, base)
    tl.store(sum_out + bh * D + e, total)


def serves(rows: DeltaRows) -> bool:
    """Whether `_delta_tokens_kernel` codes into these rows: q8_0 keyframes, symmetric 4-bit deltas (blocks of 16 or
    32 channels), fp16 means with contiguous rows, a schedule of three early snapshots."""
    if rows.keyframes.fmt.name != "q8_0" or len(rows.snapshots.points) != 3:
        return False
    if rows.deltas is not None and rows.deltas.fmt.name not in ("q4_0", "q4_0_16"):
        return False
    return rows.means is None or (rows.means.dtype == torch.float16 and rows.means.stride(-1) == 1)


def delta_tokens(
    x: torch.Tensor,
    turn: tuple | None,
    rotation: int,
    reference_state: torch.Tensor,
    running_sum: torch.Tensor | None,
    long_term: torch.Tensor | None,
    rows: DeltaRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.delta_tokens` (see there; `serves(rows)`) in one launch: the new reference state and running sum
    (new tensors)."""
    batch, heads, n, dim = x.shape
    ref_out = torch.empty(batch, heads, 1, dim, dtype=torch.float32, device=x.device)
    sum_out = torch.empty_like(ref_out)
    positions, freqs, order = turn if turn is not None else (x, x, None)
    keys = rows.keyframes
    key_codes = keys.codes.view(torch.int8)
    deltas = rows.deltas if rows.deltas is not None else keys
    means = rows.means if rows.means is not None else x
    long_rows = long_term if long_term is not None else x
    schedule = rows.snapshots
    on_device(_delta_tokens_kernel)[(batch * heads,)](
        x, positions, freqs, order if order is not None else x, reference_state.contiguous(),
        running_sum.contiguous() if running_sum is not None else ref_out, long_rows, key_codes, keys.scales,
        deltas.codes, deltas.scales, means, ref_out, sum_out,
        heads, n, rows.start, rows.key_at, rows.delta_at, rows.mean_at,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), positions.stride(0), positions.stride(-1),
        long_rows.stride(0), long_rows.stride(1), *key_codes.stride()[:3], *keys.scales.stride()[:3],
        *deltas.codes.stride()[:3], *deltas.scales.stride()[:3], *means.stride()[:3],
        D=dim, HALF=deltas.fmt.block_size // 2, ROPE=turn is not None, ORDER=order is not None,
        STAGES=log2_of(rotation), SCALE=rotation_scale(rotation) if rotation else 1.0, KF=rows.kf,
        PREVIOUS=rows.previous, INTRA=rows.intra, LONG=long_term is not None, SUM=running_sum is not None,
        DELTAS=rows.deltas is not None, MEANS=rows.means is not None, SNAP_0=schedule.points[0],
        SNAP_1=schedule.points[1], SNAP_2=schedule.points[2], SNAP_LAST=schedule.last,
        SNAP_INTERVAL=schedule.interval, **EXACT,
    )  # fmt: skip
    return ref_out, sum_out
