"""Triton kernels: decoding attention straight from the token-delta cache (`DeltaKVCache(keys="token")`), flash-
decoding style, in two launches. Specification: `reference.stream_attention` over a delta key stream.

`_delta_split_kernel`, grid (batch × kv heads, splits, blocks of query rows): a program walks its keyframe groups in
tiles of `decode_attention.tile_tokens` tokens (what keeps a tile's products in registers). It loads a tile's q8_0
keyframe and 4-bit deltas through their strides, adds the mean snapshot where a block is intra-coded, and rebuilds the
keys with a segmented prefix sum (`tl.associative_scan`, restarting at the keyframe and at intra blocks; channels
that do not restart within the tile continue from the last key of the tile before). The keys' Hadamard rotation is
undone by butterflies (their own inverse) and RoPE re-applied from the positions (`common.turn_rows`); the tile is
scored by every query row of the kv head (all its query heads, each query's causal limit or mask row) and folded
with its values into an online softmax. The merge is the adaptive keys' (`adaptive_attention.merge_splits`): splits
by log-sum-exp, the values' rotation undone once, the raw sinks folded in. Nothing is copied or written at full
precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hadamard import rotation_scale
from ..layout import DeltaStream, PlainStream, RopeAngles
from .adaptive_attention import merge_splits
from .common import (
    TILE_KINDS,
    butterflies,
    log2_of,
    mask_strides,
    on_device,
    program,
    programs,
    query_rows,
    query_rows_at,
    query_strides,
    rows_of,
    snapshots_held,
    turn_rows,
    visible,
)
from .decode_attention import fold_tile, load_rows, split_tokens, store_partials, tile_tokens


@triton.jit
def _restart_or_add(a_value, a_reset, b_value, b_reset):
    return tl.where(b_reset != 0, b_value, a_value + b_value), a_reset | b_reset


@triton.jit(do_not_specialize=("n_groups", "n_snapshots", "length", "groups_per_split", "causal_offset", "GROUP", "NQ"))
def _delta_split_kernel(
    q_ptr, kfc_ptr, kfs_ptr, dc_ptr, ds_ptr, mean_ptr, pos_ptr, freq_ptr, vc_ptr, vs_ptr, vm_ptr, mask_ptr,
    o_ptr, m_ptr, l_ptr,
    kv_heads, n_groups, n_snapshots, length, groups_per_split, sinks, scale, causal_offset,
    sqb, sqh, sqg, sqi, sfb, sfh, sfg, sgb, sgh, sgg, sdb, sdh, sdt, seb, seh, set_, snb, snh, sns, sxb, sxt,
    svb, svh, svt, swb, swh, swt, smb, smq, smt,
    GROUP, G_PAD: tl.constexpr, NQ, ONE: tl.constexpr, D: tl.constexpr, KF: tl.constexpr, T: tl.constexpr,
    BS: tl.constexpr, V_BS: tl.constexpr, V_KIND: tl.constexpr, INTRA: tl.constexpr, HAS_MEAN: tl.constexpr,
    STAGES: tl.constexpr, ROT_SCALE: tl.constexpr, ROPE: tl.constexpr, MASK: tl.constexpr,
    SNAP_0: tl.constexpr, SNAP_1: tl.constexpr, SNAP_2: tl.constexpr, SNAP_LAST: tl.constexpr,
    SNAP_INTERVAL: tl.constexpr,
):  # fmt: skip
    bh, split = program(0), program(1)
    n_splits = programs(1)
    b, h = bh // kv_heads, bh % kv_heads
    e = tl.arange(0, D)
    half: tl.constexpr = D // 2
    g = program(2) * G_PAD + tl.arange(0, G_PAD)  # this block's query rows: query g % NQ of head g // NQ
    q = tl.load(query_rows_at(q_ptr, b, h, g, sqb, sqh, sqg, sqi, NQ) + e[None, :], mask=(g < GROUP)[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    freqs = tl.load(freq_ptr + tl.arange(0, half)) if ROPE else tl.zeros((half,), tl.float64)
    blk = e // BS  # the deltas' q4_0 blocks of BS channels: byte j holds code j (low nibble) and j + BS/2 (high)
    within = e % BS
    byte = blk * (BS // 2) + within % (BS // 2)
    shift = (within // (BS // 2)) * 4
    key_codes, key_scales = kfc_ptr + b * sfb + h * sfh, kfs_ptr + b * sgb + h * sgh
    delta_codes, delta_scales = dc_ptr + b * sdb + h * sdh, ds_ptr + b * seb + h * seh
    v_codes, v_scales, v_mins = vc_ptr + b * svb + h * svh, vs_ptr + b * swb + h * swh, vm_ptr + b * swb + h * swh
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    carry = tl.zeros((D,), tl.float32)  # the reconstruction of the token before the tile (pre-rotation)
    offs = tl.arange(0, T)
    first = split * groups_per_split * KF  # (a split starts at a keyframe: nothing carried into it)
    for begin in range(first, tl.minimum(first + groups_per_split * KF, length), T):
        tok = begin + offs
        valid = tok < length
        grp, slot = tok // KF, tok % KF  # (slot 0: the group's keyframe)
        at_key = (slot == 0) & valid
        key = tl.load(key_codes + grp[:, None] * sfg + e[None, :], mask=at_key[:, None], other=0).to(tl.float32)
        key *= tl.load(key_scales + grp[:, None] * sgg + (e // 32)[None, :], mask=at_key[:, None], other=0.0).to(
            tl.float32
        )  # (q8_0 keyframes: blocks of 32)
        drow = grp * (KF - 1) + slot - 1  # offset o > 0 of group grp is delta row grp * (kf - 1) + o - 1
        dvalid = (slot >= 1) & valid
        packed = tl.load(delta_codes + drow[:, None] * sdt + byte[None, :], mask=dvalid[:, None], other=0)
        code = ((packed >> shift[None, :]) & 0x0F).to(tl.float32)
        s16 = tl.load(delta_scales + drow[:, None] * set_ + blk[None, :], mask=dvalid[:, None], other=0.0)
        delta = (code - 8.0) * s16.to(tl.float32)
        if INTRA:
            flag = (s16.to(tl.int16, bitcast=True) & 1) != 0
        else:
            flag = delta != delta  # all False
        base = tl.zeros((T, D), dtype=tl.float32)
        if HAS_MEAN:  # the newest mean snapshot before each token (`SnapshotSchedule.counts`)
            snap = snapshots_held(tok, SNAP_0, SNAP_1, SNAP_2, SNAP_LAST, SNAP_INTERVAL)
            snap = tl.minimum(snap - 1, n_snapshots - 1)
            row = mean_ptr + b * snb + h * snh + tl.maximum(snap, 0)[:, None] * sns + e[None, :]
            base = tl.load(row, mask=((snap >= 0) & dvalid)[:, None], other=0.0).to(tl.float32)
        value = tl.where(at_key[:, None], key, tl.where(flag, base + delta, delta))
        reset = (at_key[:, None] | flag).to(tl.int32)
        k, _ = tl.associative_scan((value, reset), axis=0, combine_fn=_restart_or_add)
        k = tl.where(tl.cumsum(reset, axis=0) > 0, k, k + carry[None, :])  # (no restart yet: from the carry)
        carry = tl.sum(tl.where((offs == T - 1)[:, None], k, 0.0), axis=0)
        if STAGES > 0:  # stored rotated: the butterflies are their own inverse
            k = butterflies(k, T, D, STAGES, ROT_SCALE)
        if ROPE:  # stored before RoPE: turned by each token's position
            k = turn_rows(k, tl.load(pos_ptr + b * sxb + tok * sxt, mask=valid, other=0), freqs, T, D)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        if ONE:
            if MASK:
                valid = valid & (tl.load(mask_ptr + b * smb + (sinks + tok) * smt, mask=valid, other=0) != 0)
            scores = tl.where(valid[None, :], scores, float("-inf"))
        else:  # several queries (a chunk): each row's mask row, or its causal limit
            seen = visible(valid, sinks + tok, g % NQ, b, mask_ptr, smb, smq, smt, causal_offset, MASK)
            scores = tl.where(seen, scores, float("-inf"))
        v = load_rows(v_codes, v_scales, v_mins, tok, valid, svt, swt, D, V_BS, V_KIND)
        m_i, l_i, acc = fold_tile(scores, v, m_i, l_i, acc)
    store_partials(o_ptr, m_ptr, l_ptr, bh, split, n_splits, acc, m_i, l_i, G_PAD, D)


def supports(keys: DeltaStream, values: PlainStream, mask: torch.Tensor | None = None, n_queries: int = 1) -> bool:
    """Delta keys from the previous token (symmetric 4-bit deltas, q8_0 keyframes, kf a power of two of 16-64) and
    plain block-quantized values, of one power-of-two head dim of 32-256; up to `common.MAX_QUERIES` queries, a mask of
    a row each."""
    dim, kf = keys.dim, keys.kf
    if dim < 32 or dim > 256 or dim & (dim - 1) or values.dim != dim or values.blocks.fmt.kind not in TILE_KINDS:
        return False
    if keys.reference != "previous" or kf < 16 or kf > 64 or kf & (kf - 1) or keys.keyframes.fmt.name != "q8_0":
        return False
    if keys.deltas is not None and keys.deltas.fmt.name not in ("q4_0", "q4_0_16"):
        return False
    if len(keys.snapshots.points) != 3 or not rows_of(mask, n_queries):
        return False
    stored = [*keys.keyframes.tensors(), *values.blocks.tensors()]
    stored += [] if keys.deltas is None else keys.deltas.tensors()
    return all(t.stride(-1) == 1 for t in stored) and (keys.means is None or keys.means.stride(-1) == 1)


def delta_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: DeltaStream,
    values: PlainStream,
    *,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    scale: float,
    n_queries: int = 1,
    causal_offset: int = 0,
    groups_per_split: int | None = None,
) -> torch.Tensor:
    """`reference.stream_attention` over a token-delta key stream and plain values (see `supports`): fp32
    `[batch, kv_heads, rows, dim]`, in two launches.

    Args:
        query: `[batch, kv_heads, rows, dim]` (row `g * n_queries + i`: query `i` of the kv head's `g`-th query head)
            or `[batch, kv_heads, group, n_queries, dim]`, canonical channel order with `rope`.
        rope: positions `[batch, stream tokens]` and float64 frequencies on the queries' device, or None.
        mask: bool `[batch, n_queries, sinks + stream tokens]` or None: causal, query `i` sees tokens up to
            `causal_offset + i` (sinks counted).
        groups_per_split: keyframe groups a program walks (default: `decode_attention.split_tokens`'s share).
    """
    strides, group = query_strides(query, n_queries)
    batch, kv_heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    device = query.device
    rows = query_rows(group, n_queries, causal_offset)
    keyframes, deltas, means = keys.keyframes, keys.deltas, keys.means if keys.intra else None
    n_groups = keyframes.scales.shape[2]
    if groups_per_split is None:  # the plain kernels' splits (`split_tokens`), whole groups each
        groups_per_split = split_tokens(n_groups * keys.kf, keys.kf)[1] // keys.kf
    splits = triton.cdiv(n_groups, groups_per_split)
    padded = rows.block * rows.blocks
    o = torch.empty(batch * kv_heads, splits, padded, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * kv_heads, splits, padded, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    d_codes = deltas.codes if deltas is not None else keyframes.codes  # (none read without deltas)
    d_scales = deltas.scales if deltas is not None else keyframes.scales
    means_rows = means if means is not None else keyframes.scales
    v = values.blocks
    v_codes = v.codes.view(torch.int8) if v.fmt.bits == 8 else v.codes
    v_scales = v.scales if v.scales is not None else v.codes
    v_mins = v.mins if v.mins is not None else v_scales
    positions = rope.positions if rope is not None else query
    mask_rows = mask if mask is not None else query
    schedule = keys.snapshots
    on_device(_delta_split_kernel)[(batch * kv_heads, splits, rows.blocks)](
        query, keyframes.codes.view(torch.int8), keyframes.scales, d_codes, d_scales, means_rows, positions,
        rope.freqs if rope is not None else query, v_codes, v_scales, v_mins, mask_rows, o, m, l_sum,
        kv_heads, n_groups, means.shape[2] if means is not None else 1, keys.length, groups_per_split,
        sink_keys.shape[2], float(scale), causal_offset,
        *strides, *keyframes.codes.stride()[:3], *keyframes.scales.stride()[:3], *d_codes.stride()[:3],
        *d_scales.stride()[:3], *means_rows.stride()[:3], positions.stride(0), positions.stride(-1),
        *v_codes.stride()[:3], *v_scales.stride()[:3], *mask_strides(mask),
        GROUP=group, G_PAD=rows.block, NQ=n_queries, ONE=n_queries == 1, D=dim, KF=keys.kf, T=tile_tokens(dim),
        BS=deltas.fmt.block_size if deltas is not None else 16, V_BS=v.fmt.block_size, V_KIND=int(v.fmt.kind),
        INTRA=keys.intra, HAS_MEAN=means is not None, STAGES=log2_of(keys.rotation),
        ROT_SCALE=rotation_scale(keys.rotation) if keys.rotation else 1.0, ROPE=rope is not None,
        MASK=mask is not None, SNAP_0=schedule.points[0], SNAP_1=schedule.points[1], SNAP_2=schedule.points[2],
        SNAP_LAST=schedule.last, SNAP_INTERVAL=schedule.interval, num_warps=4 if dim < 128 else 8,
    )  # fmt: skip
    return merge_splits(query, sink_keys, sink_values, (o, m, l_sum), mask, scale, values.rotation, rows)
