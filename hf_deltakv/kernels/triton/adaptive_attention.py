"""Triton kernels: decoding attention straight from DeltaKVCache's storage (adaptive per-channel keys, plain values),
in two launches. Specification: `reference.stream_attention` (one query per head).

`_adaptive_split_kernel`, grid (batch × kv heads, splits): a program loads the queries of every query head of its kv
head (GQA: each packed byte is read by one program) and walks its share of the coded groups, `T` tokens at a time.
In registers it decodes a tile's keys from their bit planes (plane k of a channel is one little-endian word holding
bit k of the group's tokens; a channel's planes follow the channels before it: an exclusive prefix sum of the
depths), `low + code * step`, re-applies RoPE from the positions (a tile of consecutive positions turns by its first
angle composed with a per-program table of `j * freq`; a tile with gaps or repeats computes every angle; angles
reduced in float64, `common.turned_cos_sin`), scores them, dequantizes the values (still rotated) and folds both into
an online softmax, whose running statistics it stores.
`_adaptive_merge_kernel`, grid (batch × kv heads): merges the splits by log-sum-exp, folds in the raw tail after the
coded groups, undoes the values' Hadamard rotation once on the merged rows (butterflies), folds in the raw sink
tokens and writes the normalised output.
Nothing the size of the history is written; the splits' statistics are `splits × query heads × (dim + 2)` floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...quant import QuantizedTensor
from ...quant.bitplanes import MAX_BITS
from ..hadamard import rotation_scale
from ..layout import AdaptiveStream, PlainStream, RopeAngles
from .common import (
    TILE_KINDS,
    Rows,
    butterflies,
    log2_of,
    mask_strides,
    on_device,
    program,
    programs,
    query_halves,
    query_rows,
    query_rows_at,
    query_strides,
    rows_of,
    saturate_fp16,
    step_state,
    turned_cos_sin,
    visible,
)

WORDS = {8: tl.uint8, 16: tl.uint16, 32: tl.uint32, 64: tl.uint64}  # a plane of a group of this many tokens
TILE_TOKENS = 16  # tokens decoded and scored at a time (head_dim 256: half): what keeps the tiles in registers
TOKENS_PER_SPLIT = 256  # a split's share of the stream at least (fewer splits at short contexts)
MAX_SPLITS = 64
_TOKENS_PER_SPLIT, _MAX_SPLITS = tl.constexpr(TOKENS_PER_SPLIT), tl.constexpr(MAX_SPLITS)  # (the kernels' copies)


@triton.jit
def _plane_codes(words_ptr, plane, depth, slot, MOST: tl.constexpr, WORD: tl.constexpr):
    """Codes int32 `[GS, C]` of C channels whose planes start at `plane` `[C]` with depths `depth` `[C]`."""
    codes = tl.zeros((slot.shape[0], plane.shape[0]), tl.int32)
    for k in tl.static_range(MOST):
        word = tl.load(words_ptr + plane + k, mask=k < depth, other=0).to(WORD)  # bit j: token j's bit k
        codes += (((word[None, :] >> slot[:, None].to(WORD)) & 1) << k).to(tl.int32)
    return codes


@triton.jit
def _product(a, b, DOT: tl.constexpr):
    """`a @ b` in fp32 (`[M, K] @ [K, N]`): a matrix instruction where the shapes allow it (all >= 16), else
    broadcast products summed."""
    if DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _value_halves(codes, scales, mins, token, valid, T: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BITS: tl.constexpr, ASYM: tl.constexpr):  # fmt: skip
    """Dequantized values of tokens `token` (rows of one head's plain stream; invalid ones read as zeros) as two
    halves `[T, D/2]`: column j of the first is channel (j // (BS/2)) * BS + j % (BS/2) of its block, the second the
    channel BS/2 further: a 4-bit byte's low and high codes (llama.cpp's order), each byte loaded once."""
    nb: tl.constexpr = D // BS
    half: tl.constexpr = BS // 2
    j = tl.arange(0, D // 2)
    s = tl.load(scales + token[:, None] * nb + tl.arange(0, nb)[None, :], mask=valid[:, None], other=0.0)
    s = tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (T, nb, half)), (T, D // 2))
    if BITS == 8:
        first = (j // half) * BS + j % half
        a = tl.load(codes + token[:, None] * D + first[None, :], mask=valid[:, None], other=0).to(tl.float32) * s
        b = tl.load(codes + token[:, None] * D + half + first[None, :], mask=valid[:, None], other=0).to(tl.float32)
        return a, b * s
    packed = tl.load(codes + token[:, None] * (D // 2) + j[None, :], mask=valid[:, None], other=0)
    low, high = (packed & 0x0F).to(tl.float32), (packed >> 4).to(tl.float32)
    if ASYM:
        m = tl.load(mins + token[:, None] * nb + tl.arange(0, nb)[None, :], mask=valid[:, None], other=0.0)
        m = tl.reshape(tl.broadcast_to(m.to(tl.float32)[:, :, None], (T, nb, half)), (T, D // 2))
        return low * s + m, high * s + m
    return (low - 8.0) * s, (high - 8.0) * s


@triton.jit
def _fold(scores, v_a, v_b, m_i, l_i, acc_a, acc_b, DOT: tl.constexpr):
    """Fold a tile (scores `[G, T]`, values as two halves `[T, D/2]`) into the running max, sum and weighted
    values."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc_a = acc_a * alpha[:, None] + _product(p, v_a, DOT)
    acc_b = acc_b * alpha[:, None] + _product(p, v_b, DOT)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc_a, acc_b


@triton.jit
def _attend(
    q_lo, q_hi, k_lo, k_hi, token, valid, m_i, l_i, acc_a, acc_b, b, freqs, step_cos, step_sin,
    pos_ptr, mask_ptr, head_codes, head_scales, head_mins, sinks, scale, sxb, sxt, smb, smq, smt, g, causal_offset,
    T: tl.constexpr, D: tl.constexpr, V_BLOCK: tl.constexpr, V_BITS: tl.constexpr, V_ASYM: tl.constexpr,
    ROPE: tl.constexpr, MASK: tl.constexpr, DOT: tl.constexpr, NQ, ONE: tl.constexpr,
):  # fmt: skip
    """A tile's keys (`[T, D/2]` halves, canonical, before RoPE) scored by query rows `g` and folded with its values;
    `step_cos`, `step_sin`: of `j * freq` for the tile's slots j."""
    if MASK and ONE:
        seen = tl.load(mask_ptr + b * smb + (sinks + token) * smt, mask=valid, other=0)
        valid = valid & (seen != 0)
    if ROPE:
        slot = tl.arange(0, T)
        pos = tl.load(pos_ptr + b * sxb + token * sxt, mask=valid, other=0)
        start = tl.min(tl.where(valid, pos - slot, 2147483647), axis=0)  # the unit's first angle, if consecutive
        base_cos, base_sin = turned_cos_sin(start, freqs)
        cos = base_cos[None, :] * step_cos - base_sin[None, :] * step_sin
        sin = base_sin[None, :] * step_cos + base_cos[None, :] * step_sin
        if tl.sum((valid & (pos != start + slot)).to(tl.int32), axis=0) != 0:  # gaps or repeats: every angle
            cos, sin = turned_cos_sin(pos[:, None], freqs[None, :])
        k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
    scores = _product(q_lo, tl.trans(k_lo), DOT) + _product(q_hi, tl.trans(k_hi), DOT)
    if ONE:
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
    else:  # several queries (a chunk): each row's mask row, or its causal limit
        seen = visible(valid, sinks + token, g % NQ, b, mask_ptr, smb, smq, smt, causal_offset, MASK)
        scores = tl.where(seen, scores * scale, float("-inf"))
    v_a, v_b = _value_halves(head_codes, head_scales, head_mins, token, valid, T, D, V_BLOCK, V_BITS, V_ASYM)
    return _fold(scores, v_a, v_b, m_i, l_i, acc_a, acc_b, DOT)


@triton.jit
def _live(state_ptr, sinks, pad, capacity, GS: tl.constexpr):
    """A decoding step's tokens held, coded groups, stream tokens and splits (as `adaptive_attention` sizes them) from
    a layer's device counters (`common.step_state`, after the step's bookkeeping): (held, coded, length, splits,
    groups per split)."""
    held, coded, _, _, _ = step_state(state_ptr, sinks, pad, GS, capacity)
    length = tl.maximum(held - sinks, 0)
    splits = tl.minimum(tl.minimum((length + _TOKENS_PER_SPLIT - 1) // _TOKENS_PER_SPLIT, _MAX_SPLITS), coded)
    per_split = tl.where(splits > 0, (coded + splits - 1) // tl.maximum(splits, 1), 0)
    splits = tl.where(per_split > 0, (coded + per_split - 1) // tl.maximum(per_split, 1), 0)
    return held, coded, length, splits, per_split


@triton.jit(do_not_specialize=("n_coded", "length", "units_per_split", "causal_offset", "GROUP", "NQ"))
def _adaptive_split_kernel(
    q_ptr, planes_ptr, depths_ptr, low_ptr, step_ptr, pos_ptr, freq_ptr, vc_ptr, vs_ptr, vm_ptr, mask_ptr,
    o_ptr, m_ptr, l_ptr, state_ptr,
    kv_heads, n_coded, length, pad, sinks, units_per_split, scale, causal_offset, capacity,
    sqb, sqh, sqg, sqi, spb, sph, spg, sdb, sdh, sdg, slb, slh, slg, ssb, ssh, ssg, sxb, sxt, svb, svh, swb, swh, smb,
    smq, smt,
    GROUP, G_PAD: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, T: tl.constexpr,
    WORD: tl.constexpr, V_BLOCK: tl.constexpr, V_BITS: tl.constexpr, V_ASYM: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr, MOST: tl.constexpr, DOT: tl.constexpr, NQ, ONE: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    bh, split = program(0), program(1)
    n_splits = programs(1)
    if STATE:  # a decoding step with device counters (`step.attention_step`): the grid sized for the capacity,
        # the splits past the live ones read nothing (their statistics: empty)
        _, n_coded, length, _, units_per_split = _live(state_ptr, sinks, pad, capacity, GS)
    b, h = bh // kv_heads, bh % kv_heads
    half: tl.constexpr = D // 2
    c = tl.arange(0, half)
    g = program(2) * G_PAD + tl.arange(0, G_PAD)  # this block's query rows: query g % NQ of head g // NQ
    q_lo, q_hi = query_halves(q_ptr, b, h, sqb, sqh, sqg, sqi, c, c + half, g, GROUP, NQ)
    freqs = tl.load(freq_ptr + c) if ROPE else tl.zeros((half,), tl.float64)
    step_cos, step_sin = turned_cos_sin(tl.arange(0, T)[:, None], freqs[None, :])  # of j * freq, a tile's slots j
    words = planes_ptr.to(tl.pointer_type(WORD)) + b * spb + h * sph  # (strides in words)
    head_codes = vc_ptr + b * svb + h * svh
    head_scales = vs_ptr + b * swb + h * swh
    head_mins = vm_ptr + b * swb + h * swh
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc_a = tl.zeros((G_PAD, half), tl.float32)
    acc_b = tl.zeros((G_PAD, half), tl.float32)
    first = split * units_per_split
    for unit in range(first, tl.minimum(first + units_per_split, n_coded)):  # coded groups: unit * GS + slot - pad
        packed = tl.load(depths_ptr + b * sdb + h * sdh + unit * sdg + c).to(tl.int32)
        d_lo, d_hi = packed & 15, packed >> 4
        p_lo = tl.cumsum(d_lo, axis=0) - d_lo
        p_hi = tl.sum(d_lo, axis=0) + tl.cumsum(d_hi, axis=0) - d_hi
        group_words = words + unit * spg
        at_low = low_ptr + b * slb + h * slh + unit * slg
        at_step = step_ptr + b * ssb + h * ssh + unit * ssg
        low_lo, low_hi = tl.load(at_low + c).to(tl.float32), tl.load(at_low + half + c).to(tl.float32)
        step_lo, step_hi = tl.load(at_step + c).to(tl.float32), tl.load(at_step + half + c).to(tl.float32)
        for part in tl.static_range(GS // T):  # the group a tile of T tokens at a time
            slot = part * T + tl.arange(0, T)
            token = unit * GS + slot - pad
            valid = (token >= 0) & (token < length)
            k_lo = (
                low_lo[None, :]
                + _plane_codes(group_words, p_lo, d_lo, slot, MOST, WORD).to(tl.float32) * step_lo[None, :]
            )
            k_hi = (
                low_hi[None, :]
                + _plane_codes(group_words, p_hi, d_hi, slot, MOST, WORD).to(tl.float32) * step_hi[None, :]
            )
            k_lo = saturate_fp16(k_lo).to(tl.float16).to(tl.float32)  # fp16 values (reference.decode_groups)
            k_hi = saturate_fp16(k_hi).to(tl.float16).to(tl.float32)
            m_i, l_i, acc_a, acc_b = _attend(
                q_lo, q_hi, k_lo, k_hi, token, valid, m_i, l_i, acc_a, acc_b, b, freqs, step_cos, step_sin,
                pos_ptr, mask_ptr, head_codes, head_scales, head_mins, sinks, scale, sxb, sxt, smb, smq, smt, g,
                causal_offset, T, D, V_BLOCK, V_BITS, V_ASYM, ROPE, MASK, DOT, NQ, ONE,
            )  # fmt: skip
    out = (bh * n_splits + split) * (programs(2) * G_PAD) + g
    channel = (c // (V_BLOCK // 2)) * V_BLOCK + c % (V_BLOCK // 2)  # the halves' columns (see _value_halves)
    tl.store(o_ptr + out[:, None] * D + channel[None, :], acc_a)
    tl.store(o_ptr + out[:, None] * D + V_BLOCK // 2 + channel[None, :], acc_b)
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit(do_not_specialize=("n_splits", "coded", "tail_tokens", "causal_offset", "GROUP", "NQ"))
def _adaptive_merge_kernel(
    q_ptr, sk_ptr, sv_ptr, tail_ptr, pos_ptr, freq_ptr, vc_ptr, vs_ptr, vm_ptr, mask_ptr, o_ptr, m_ptr, l_ptr,
    out_ptr, stats_ptr, state_ptr,
    kv_heads, n_splits, sinks, coded, tail_tokens, scale, causal_offset, pad, capacity,
    sqb, sqh, sqg, sqi, skb, skh, skt, svb, svh, svt, stb, sth, stt, sxb, sxt, scb, sch, swb, swh, smb, smq, smt,
    GROUP, G_PAD: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, T: tl.constexpr,
    V_BLOCK: tl.constexpr, V_BITS: tl.constexpr, V_ASYM: tl.constexpr, ROPE: tl.constexpr, MASK: tl.constexpr,
    STAGES: tl.constexpr, ROT_SCALE: tl.constexpr, DOT: tl.constexpr, TAIL: tl.constexpr, STATS: tl.constexpr,
    NQ, ONE: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    bh = program(0)
    b, h = bh // kv_heads, bh % kv_heads
    stride = n_splits  # (the splits' statistics: `n_splits` of them a row; with STATE the live ones read)
    if STATE:  # a decoding step with device counters: the live splits, the tail's tokens and the sinks held
        held, n_coded, length, n_splits, _ = _live(state_ptr, sinks, pad, capacity, GS)
        coded = tl.where(n_coded > 0, n_coded * GS - pad, 0)
        tail_tokens = length - coded
        sinks = tl.minimum(held, sinks)
    half: tl.constexpr = D // 2
    g = program(1) * G_PAD + tl.arange(0, G_PAD)  # this block's query rows (see the split kernels)
    r_pad = programs(1) * G_PAD
    c = tl.arange(0, half)
    e = tl.arange(0, D)
    channel = (c // (V_BLOCK // 2)) * V_BLOCK + c % (V_BLOCK // 2)  # the value halves' columns (_value_halves)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc_a = tl.zeros((G_PAD, half), tl.float32)
    acc_b = tl.zeros((G_PAD, half), tl.float32)
    for s in range(n_splits):  # the splits, by log-sum-exp
        at = (bh * stride + s) * r_pad + g
        m_s, l_s = tl.load(m_ptr + at), tl.load(l_ptr + at)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        mine, theirs = tl.exp(m_i - m_safe), tl.exp(m_s - m_safe)
        l_i = l_i * mine + l_s * theirs
        acc_a = acc_a * mine[:, None] + tl.load(o_ptr + at[:, None] * D + channel[None, :]) * theirs[:, None]
        acc_b = (
            acc_b * mine[:, None] + tl.load(o_ptr + at[:, None] * D + V_BLOCK // 2 + channel[None, :]) * theirs[:, None]
        )
        m_i = m_new
    rows = query_rows_at(q_ptr, b, h, g, sqb, sqh, sqg, sqi, NQ)
    q_lo, q_hi = query_halves(q_ptr, b, h, sqb, sqh, sqg, sqi, c, c + half, g, GROUP, NQ)
    if TAIL:  # the raw tail after the coded groups (values still rotated, like the splits'), T at a time
        freqs = tl.load(freq_ptr + c) if ROPE else tl.zeros((half,), tl.float64)
        step_cos, step_sin = turned_cos_sin(tl.arange(0, T)[:, None], freqs[None, :])
        for part in tl.static_range(GS // T):
            slot = part * T + tl.arange(0, T)
            valid = slot < tail_tokens
            raw = tail_ptr + b * stb + h * sth + slot[:, None] * stt
            k_lo = tl.load(raw + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            k_hi = tl.load(raw + half + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            m_i, l_i, acc_a, acc_b = _attend(
                q_lo, q_hi, k_lo, k_hi, coded + slot, valid, m_i, l_i, acc_a, acc_b, b, freqs, step_cos, step_sin,
                pos_ptr, mask_ptr, vc_ptr + b * scb + h * sch, vs_ptr + b * swb + h * swh, vm_ptr + b * swb + h * swh,
                sinks, scale, sxb, sxt, smb, smq, smt, g, causal_offset, T, D, V_BLOCK, V_BITS, V_ASYM, ROPE, MASK,
                DOT, NQ, ONE,
            )  # fmt: skip
    # the halves back in channel order: [G, blocks, half block] pairs joined, then the values' rotation undone
    nb: tl.constexpr = D // V_BLOCK
    a3 = tl.reshape(acc_a, (G_PAD, nb, V_BLOCK // 2))
    b3 = tl.reshape(acc_b, (G_PAD, nb, V_BLOCK // 2))
    acc = tl.reshape(tl.permute(tl.join(a3, b3), (0, 1, 3, 2)), (G_PAD, D))
    if STAGES > 0:  # (the butterflies are their own inverse)
        acc = butterflies(acc, G_PAD, D, STAGES, ROT_SCALE)
    q = tl.load(rows + e[None, :], mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
    for j in range(sinks):
        key = tl.load(sk_ptr + b * skb + h * skh + j * skt + e).to(tl.float32)
        value = tl.load(sv_ptr + b * svb + h * svh + j * svt + e).to(tl.float32)
        score = tl.sum(q * key[None, :], axis=1) * scale
        if not ONE:  # each query row's mask row, or its causal limit (sink j is column j)
            column = tl.full((1,), j, tl.int32)
            seen = visible(column == column, column, g % NQ, b, mask_ptr, smb, smq, smt, causal_offset, MASK)
            score = tl.where(tl.reshape(seen, (G_PAD,)), score, float("-inf"))
        elif MASK:
            score = tl.where(tl.load(mask_ptr + b * smb + j * smt) != 0, score, float("-inf"))
        m_new = tl.maximum(m_i, score)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, p = tl.exp(m_i - m_safe), tl.exp(score - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * value[None, :]
        m_i = m_new
    out = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]  # OnlineSoftmax.result: nothing seen gives zeros
    tl.store(out_ptr + (bh * GROUP + g[:, None]) * D + e[None, :], out, mask=(g < GROUP)[:, None])
    if STATS:  # the softmax's final max and sum of each row (`layout.Observation`)
        tl.store(stats_ptr + bh * r_pad + g, m_i)
        tl.store(stats_ptr + (programs(0) + bh) * r_pad + g, l_i)


def words_aligned(planes: torch.Tensor | None, group: int) -> bool:
    """Whether bit planes `uint8 [B, H, rows, total, group / 8]` can be read as words of `group / 8` bytes (what the
    kernels do): the storage and every stride on word boundaries (an offset view would be a misaligned address on a
    GPU, where the interpreter reads any address)."""
    word = group // 8
    return planes is None or (planes.data_ptr() % word == 0 and all(s % word == 0 for s in planes.stride()[:-1]))


def supports(keys: AdaptiveStream, values: PlainStream, mask: torch.Tensor | None, n_queries: int = 1) -> bool:
    """Adaptive keys and plain block-quantized values (q4_0, q4_1, q8_0 families) of one power-of-two width, groups
    of 8-64 tokens, the rows of their storage contiguous past the sequence dimension and the planes on word boundaries
    (`words_aligned`); a mask of a row per query."""
    dim, fmt = keys.dim, values.blocks.fmt
    if dim != values.dim or dim < 16 or dim & (dim - 1) or fmt.kind not in TILE_KINDS or dim % fmt.block_size:
        return False
    if keys.group not in WORDS or not rows_of(mask, n_queries) or not words_aligned(keys.planes, keys.group):
        return False
    stored = [keys.tail, values.blocks.codes, values.blocks.scales]
    if keys.planes is not None:
        stored += [keys.planes, keys.bits, keys.low, keys.step]
    return all(t.stride(-1) == 1 for t in stored) and keys.tail.shape[2] <= keys.group


def adaptive_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: AdaptiveStream,
    values: PlainStream,
    *,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    scale: float,
    n_queries: int = 1,
    causal_offset: int = 0,
    state: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """`reference.stream_attention` (see `supports`): fp32 `[batch, kv_heads, rows, dim]`. With `state` (a decoding
    step of a layer with device counters, `step.attention_step`: the counters and the tokens the layer can hold;
    `keys` and `values` its whole buffers, `keys.length` the stream's capacity), what is held is read from the
    counters on the device: the grid is the capacity's.

    Args:
        query: `[batch, kv_heads, rows, dim]` (any float dtype and strides, canonical channel order): row
            `g * n_queries + i` is query `i` of the kv head's `g`-th query head; or `[batch, kv_heads, group,
            n_queries, dim]`.
        sink_keys, sink_values: `[batch, kv_heads, sinks, dim]`.
        rope: positions `[batch, stream tokens]` and float64 frequencies on the queries' device, or None.
        mask: bool `[batch, n_queries, sinks + stream tokens]` or None: causal, query `i` sees tokens up to
            `causal_offset + i` (sinks counted).
    """
    strides, group = query_strides(query, n_queries)
    batch, kv_heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    device = query.device
    tile = min(keys.group, TILE_TOKENS if dim <= 128 else TILE_TOKENS // 2)
    dot = False  # (matrix instructions, which need 16 query rows, took more registers in the AOT compile)
    rows = query_rows(group, n_queries, causal_offset)
    g_pad, blocks = rows.block, rows.blocks
    n_coded = 0 if keys.planes is None else keys.planes.shape[2]
    coded = n_coded * keys.group - keys.offset if n_coded else 0
    splits = min(MAX_SPLITS, triton.cdiv(keys.length, TOKENS_PER_SPLIT), n_coded)  # none without coded groups
    per_split = triton.cdiv(n_coded, splits) if splits else 0
    splits = triton.cdiv(n_coded, per_split) if splits else 0
    o = torch.empty(batch * kv_heads, splits, blocks * g_pad, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * kv_heads, splits, blocks * g_pad, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    v: QuantizedTensor = values.blocks
    v_codes = v.codes.view(torch.int8) if v.fmt.bits == 8 else v.codes
    v_mins = v.mins if v.mins is not None else v.scales
    positions = rope.positions if rope is not None else keys.tail
    freqs = rope.freqs if rope is not None else keys.tail
    mask_rows = mask if mask is not None else keys.tail
    if splits:
        word_bytes = keys.group // 8
        plane_strides = [s // word_bytes for s in keys.planes.stride()[:3]]  # in words (a plane is one)
        on_device(_adaptive_split_kernel)[(batch * kv_heads, splits, blocks)](
            query, keys.planes, keys.bits, keys.low, keys.step, positions, freqs, v_codes, v.scales, v_mins,
            mask_rows, o, m, l_sum, state[0] if state is not None else o,
            kv_heads, n_coded, keys.length, keys.offset, sink_keys.shape[2], per_split, float(scale), causal_offset,
            state[1] if state is not None else 0,
            *strides, *plane_strides, *keys.bits.stride()[:3], *keys.low.stride()[:3],
            *keys.step.stride()[:3], positions.stride(0), positions.stride(-1), v_codes.stride(0), v_codes.stride(1),
            v.scales.stride(0), v.scales.stride(1), *mask_strides(mask),
            GROUP=group, G_PAD=g_pad, D=dim, GS=keys.group, T=tile, WORD=WORDS[keys.group], V_BLOCK=v.fmt.block_size,
            V_BITS=v.fmt.bits, V_ASYM=v.mins is not None, ROPE=rope is not None, MASK=mask is not None,
            MOST=MAX_BITS, DOT=dot, NQ=n_queries, ONE=n_queries == 1, STATE=state is not None,
            num_warps=4 if dim < 128 else 8,
        )  # fmt: skip
    tail = Tail(keys.tail, coded, positions, freqs, v, keys.group, tile, rope is not None)
    live = None if state is None else (state[0], keys.offset, state[1])
    return merge_splits(query, sink_keys, sink_values, (o, m, l_sum), mask, scale, values.rotation, rows, tail, dot,
                        state=live)  # fmt: skip


@dataclass(frozen=True)
class Tail:
    """Raw keys after the splits' tokens, attended by the merge (`_attend`): `tokens [batch, kv_heads, < group, dim]`
    (before RoPE when `rope`), stream tokens `coded...` on, with their values in `values` (rotated like the splits')."""

    tokens: torch.Tensor
    coded: int
    positions: torch.Tensor
    freqs: torch.Tensor
    values: QuantizedTensor
    group: int
    tile: int
    rope: bool


def merge_splits(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    scale: float,
    rotation: int,
    rows: Rows,
    tail: Tail | None = None,
    dot: bool = False,
    stats: torch.Tensor | None = None,
    state: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """`_adaptive_merge_kernel`: the splits' statistics `partials` (`o [batch * kv_heads, splits, rows, dim]` in
    channel order, values rotated by `rotation`; `m`, `l [batch * kv_heads, splits, rows]`; the query rows laid out
    as `rows` says), the raw `tail` if any and the sinks merged into the normalised fp32 output
    `[batch, kv_heads, rows, dim]`; with `stats` (fp32 `[2, batch * kv_heads, padded rows]`), each row's softmax's
    final max and sum written there too. With `state` (the device counters, the stream's `pad` and the layer's
    capacity: `adaptive_attention`'s), the live splits, the tail's tokens and the sinks held are read from the
    counters."""
    strides, group = query_strides(query, rows.n_queries)
    batch, kv_heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    o, m, l_sum = partials
    mask_rows = mask if mask is not None else query
    if tail is None:  # nothing read but the splits and the sinks (stand-ins for the tail's tensors)
        tokens, coded, positions, freqs, rope, gs, tile = query[:, :, :0], 0, query, query, False, dim, dim
        v_codes = v_scales = v_mins = query
        v_block, v_bits, v_asym = dim, 4, False
    else:
        tokens, coded, positions, freqs, rope, gs, tile = (tail.tokens, tail.coded, tail.positions, tail.freqs,
                                                           tail.rope, tail.group, tail.tile)  # fmt: skip
        v = tail.values
        v_codes = v.codes.view(torch.int8) if v.fmt.bits == 8 else v.codes
        v_scales, v_mins = v.scales, v.mins if v.mins is not None else v.scales
        v_block, v_bits, v_asym = v.fmt.block_size, v.fmt.bits, v.mins is not None
    out = torch.empty(batch, kv_heads, group, dim, dtype=torch.float32, device=query.device)
    on_device(_adaptive_merge_kernel)[(batch * kv_heads, rows.blocks)](
        query, sink_keys, sink_values, tokens, positions, freqs, v_codes, v_scales, v_mins, mask_rows,
        o, m, l_sum, out, stats if stats is not None else out, state[0] if state is not None else out,
        kv_heads, o.shape[1], sink_keys.shape[2], coded, tokens.shape[2], float(scale), rows.causal_offset,
        *(state[1:] if state is not None else (0, 0)),
        *strides, *sink_keys.stride()[:3], *sink_values.stride()[:3], *tokens.stride()[:3],
        positions.stride(0), positions.stride(-1), v_codes.stride(0), v_codes.stride(1), v_scales.stride(0),
        v_scales.stride(1), *mask_strides(mask),
        GROUP=group, G_PAD=rows.block, D=dim, GS=gs, T=tile, V_BLOCK=v_block, V_BITS=v_bits, V_ASYM=v_asym,
        ROPE=rope, MASK=mask is not None, STAGES=log2_of(rotation),
        ROT_SCALE=rotation_scale(rotation) if rotation else 1.0, DOT=dot, TAIL=tokens.shape[2] > 0,
        STATS=stats is not None, NQ=rows.n_queries, ONE=rows.n_queries == 1, STATE=state is not None,
        num_warps=4 if dim < 256 else 8,
    )  # fmt: skip
    return out
