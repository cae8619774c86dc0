"""Triton kernel: decode attention straight from the delta cache (flash-decoding / split-K, GQA-aware).
Specification: `reference.stream_attention` (one query per head, the stream part; sinks are merged by the caller).

Grid: (batch × kv_heads, splits). A program walks its keyframe groups; a group is one tile of `kf` tokens. It loads
the group's q8_0 keyframe and 4-bit deltas, adds the mean snapshot where a block is intra-coded, and rebuilds the
keys with a segmented prefix sum (`tl.associative_scan`, restarting at the keyframe and at intra blocks). The
Hadamard rotation is undone and RoPE re-applied with two small matrix products (`x @ H` and `x @ H @ P`, `P` being
rotate-half), then the tile is scored against every query head sharing the kv head and folded into an online
softmax with the dequantized values. Values stay in their rotated basis (undone once on the result). Nothing is
written back at full precision. Plain `tl` operations only (NVIDIA and AMD).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..hadamard import rotate, rotation_matrix
from ..layout import DeltaStream, PlainStream
from .decode_attention import TILE_KINDS, _load_tile, combine_splits, fold_tile, load_queries, store_partials


@triton.jit
def _restart_or_add(a_value, a_reset, b_value, b_reset):
    return tl.where(b_reset != 0, b_value, a_value + b_value), a_reset | b_reset


@triton.jit
def _delta_attention_kernel(
    q_ptr,
    kfc_ptr,
    kfs_ptr,
    dc_ptr,
    ds_ptr,
    mean_ptr,
    h_ptr,
    hp_ptr,
    cos_ptr,
    sin_ptr,
    vc_ptr,
    vs_ptr,
    vm_ptr,
    mask_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    kv_heads,
    n_groups,
    n_deltas,
    n_snapshots,
    length,
    groups_per_split,
    mask_length,
    sinks,
    scale,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    KF: tl.constexpr,
    BS: tl.constexpr,
    V_BLOCK: tl.constexpr,
    V_BITS: tl.constexpr,
    V_ASYM: tl.constexpr,
    INTRA: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    ROTATE: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SNAP_0: tl.constexpr,
    SNAP_1: tl.constexpr,
    SNAP_2: tl.constexpr,
    SNAP_LAST: tl.constexpr,
    SNAP_INTERVAL: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // kv_heads
    e = tl.arange(0, D)
    offs = tl.arange(0, KF)
    q = load_queries(q_ptr, bh, GROUP, G_PAD, D)
    if ROTATE:
        hm = tl.load(h_ptr + e[:, None] * D + e[None, :])
    if ROPE:
        hpm = tl.load(hp_ptr + e[:, None] * D + e[None, :])
    half: tl.constexpr = BS // 2
    blk = e // BS
    within = e % BS
    byte = blk * half + within % half
    shift = (within // half) * 4
    n_blocks: tl.constexpr = D // BS
    v_blocks: tl.constexpr = D // V_BLOCK
    v_bytes: tl.constexpr = D if V_BITS == 8 else D // 2
    v_codes = vc_ptr + bh * length * v_bytes
    v_scales = vs_ptr + bh * length * v_blocks
    v_mins = vm_ptr + bh * length * v_blocks
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, n_groups)
    for grp in range(first, last):
        tok = grp * KF + offs
        valid = tok < length
        kf_row = bh * n_groups + grp
        key = tl.load(kfc_ptr + kf_row * D + e).to(tl.float32) * tl.load(kfs_ptr + kf_row * (D // 32) + e // 32).to(
            tl.float32
        )
        drow = bh * n_deltas + grp * (KF - 1) + offs - 1
        dvalid = (offs >= 1) & valid
        packed = tl.load(dc_ptr + drow[:, None] * (D // 2) + byte[None, :], mask=dvalid[:, None], other=0)
        code = ((packed >> shift[None, :]) & 0x0F).to(tl.float32)
        s16 = tl.load(ds_ptr + drow[:, None] * n_blocks + blk[None, :], mask=dvalid[:, None], other=0.0)
        delta = (code - 8.0) * s16.to(tl.float32)
        if INTRA:
            flag = (s16.to(tl.int16, bitcast=True) & 1) != 0
        else:
            flag = delta != delta  # all False
        base = tl.zeros((KF, D), dtype=tl.float32)
        if HAS_MEAN:
            snap = tl.where(
                tok < SNAP_LAST,
                (tok >= SNAP_0).to(tl.int32) + (tok >= SNAP_1).to(tl.int32) + (tok >= SNAP_2).to(tl.int32),
                4 + (tok - SNAP_LAST) // SNAP_INTERVAL,
            )
            snap = tl.minimum(snap - 1, n_snapshots - 1)
            row = bh * n_snapshots + tl.maximum(snap, 0)
            base = tl.load(mean_ptr + row[:, None] * D + e[None, :], mask=((snap >= 0) & dvalid)[:, None], other=0.0)
            base = base.to(tl.float32)
        value = tl.where((offs == 0)[:, None], key[None, :], tl.where(flag, base + delta, delta))
        reset = ((offs == 0)[:, None] | flag).to(tl.int32)
        x, _ = tl.associative_scan((value, reset), axis=0, combine_fn=_restart_or_add)
        if ROTATE:
            k = tl.dot(x, hm, input_precision="ieee")
        else:
            k = x
        if ROPE:
            table = (b * length + tok)[:, None] * D + e[None, :]
            cos = tl.load(cos_ptr + table, mask=valid[:, None], other=0.0)
            sin = tl.load(sin_ptr + table, mask=valid[:, None], other=0.0)
            k = k * cos + tl.dot(x, hpm, input_precision="ieee") * sin
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        allowed = valid
        if HAS_MASK:
            allowed = allowed & (tl.load(mask_ptr + b * mask_length + sinks + tok, mask=valid, other=0) != 0)
        scores = tl.where(allowed[None, :], scores, float("-inf"))
        v = _load_tile(v_codes, v_scales, v_mins, tok, allowed, D, V_BLOCK, V_BITS, V_ASYM)
        m_i, l_i, acc = fold_tile(scores, v, m_i, l_i, acc)
    store_partials(o_ptr, m_ptr, l_ptr, bh, split, n_splits, acc, m_i, l_i, G_PAD, D)


@functools.cache
def _matrices(dim: int, rotation: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' rotation H and `H @ P`, P with `x @ P == rotate_half(x)` (`cat(-x[half:], x[:half])`), contiguous
    fp32 on the device: made once per shape and device (not at every call)."""
    half = dim // 2
    p = torch.zeros(dim, dim)
    idx = torch.arange(half)
    p[idx + half, idx] = -1.0
    p[idx, idx + half] = 1.0
    h = rotation_matrix(dim, rotation)
    return h.contiguous().to(device), (h @ p).contiguous().to(device)


# The kernel holds the head's rotation and rotate-half matrices (dim x dim, fp32) in shared memory: at head_dim 256 that
# is 256-352 KB, beyond every GPU target (benchmarks/triton_compile.py), so such heads take the reference.
MAX_DIM = 128


def supports(keys: DeltaStream, values: PlainStream) -> bool:
    """Delta keys from the previous token (symmetric 4-bit deltas, q8_0 keyframes, kf a power of two >= 16) and plain
    block-quantized values, of one power-of-two head dim that is a multiple of 32, at most `MAX_DIM`."""
    dim, kf = keys.dim, keys.kf
    if dim % 32 or dim & (dim - 1) or dim > MAX_DIM or values.dim != dim or values.blocks.fmt.kind not in TILE_KINDS:
        return False
    if keys.reference != "previous" or kf < 16 or kf & (kf - 1) or keys.keyframes.fmt.name != "q8_0":
        return False
    return keys.deltas is None or keys.deltas.fmt.name in ("q4_0", "q4_0_16")


def delta_attention(
    query: torch.Tensor,
    keys: DeltaStream,
    values: PlainStream,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    sinks: int,
    scale: float,
    groups_per_split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax statistics `(acc, max, sum)` of one query per head over a delta-coded key stream and a plain
    value stream (spec: `reference.stream_attention` without sinks); `acc` in the values' original basis.

    Args:
        query: fp32 `[batch, kv_heads, group, dim]`.
        keys, values: see `supports`.
        cos, sin: fp32 `[batch, tokens, dim]` or None; mask: bool `[batch, sinks + tokens]` or None.
    """
    batch, kv_heads, group, dim = query.shape
    kf, length = keys.kf, keys.length
    keyframes, deltas = keys.keyframes, keys.deltas
    n_groups = keyframes.scales.shape[2]
    device = query.device
    h, h_half = _matrices(dim, keys.rotation, device)
    means = keys.means if keys.intra else None
    schedule = keys.snapshots
    if len(schedule.points) != 3:
        raise ValueError("the Triton delta kernel reads a mean snapshot schedule of three growing points")
    g_pad = max(triton.next_power_of_2(group), 1)
    groups_per_split = groups_per_split or max(1, triton.cdiv(n_groups, 64))
    splits = triton.cdiv(n_groups, groups_per_split)
    o = torch.empty(batch * kv_heads, splits, g_pad, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * kv_heads, splits, g_pad, dtype=torch.float32, device=device)
    total = torch.empty_like(m)
    dummy = o
    d_codes = deltas.codes.contiguous() if deltas is not None else torch.zeros(1, dtype=torch.uint8, device=device)
    d_scales = deltas.scales.contiguous() if deltas is not None else torch.zeros(1, dtype=torch.float16, device=device)
    v = values.blocks
    _delta_attention_kernel[(batch * kv_heads, splits)](
        query.float().contiguous(),
        keyframes.codes.contiguous().view(torch.int8),
        keyframes.scales.contiguous(),
        d_codes,
        d_scales,
        means.contiguous() if means is not None else dummy,
        h,
        h_half,
        cos.contiguous() if cos is not None else dummy,
        sin.contiguous() if sin is not None else dummy,
        v.codes.contiguous().view(torch.int8) if v.fmt.bits == 8 else v.codes.contiguous(),
        v.scales.contiguous(),
        v.mins.contiguous() if v.mins is not None else v.scales.contiguous(),
        mask.to(torch.uint8).contiguous() if mask is not None else dummy,
        o,
        m,
        total,
        kv_heads,
        n_groups,
        deltas.scales.shape[2] if deltas is not None else 0,
        means.shape[2] if means is not None else 1,
        length,
        groups_per_split,
        mask.shape[-1] if mask is not None else 0,
        sinks,
        float(scale),
        GROUP=group,
        G_PAD=g_pad,
        D=dim,
        KF=kf,
        BS=deltas.fmt.block_size if deltas is not None else 16,
        V_BLOCK=v.fmt.block_size,
        V_BITS=v.fmt.bits,
        V_ASYM=v.mins is not None,
        INTRA=keys.intra,
        HAS_MEAN=means is not None,
        ROTATE=bool(keys.rotation),
        ROPE=cos is not None,
        HAS_MASK=mask is not None,
        SNAP_0=schedule.points[0],
        SNAP_1=schedule.points[1],
        SNAP_2=schedule.points[2],
        SNAP_LAST=schedule.last,
        SNAP_INTERVAL=schedule.interval,
    )
    acc, top, total = (t[:, :group] for t in combine_splits(o, m, total))
    acc = rotate(acc, inverse=True) if values.rotation else acc
    shape = (batch, kv_heads, group)
    return acc.reshape(*shape, dim), top.reshape(shape), total.reshape(shape)
