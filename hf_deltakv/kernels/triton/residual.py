"""Triton kernels of the residual cache's decoding step (`residual.layer`, no references):

- `write_raw` (one launch): new tokens into the raw window's room, in its dtype (fp16 saturating). Specification:
  `reference.write_rows` of `quant.saturate_fp16`'d (or cast) tokens.
- `encode_latent_into` (one launch, a program per tile of tokens and stored latent group): the raw tokens leaving the
  window turned back by their RoPE into the canonical order, less the mean, times the encoder's columns of the group,
  quantized at the group's depth (absmax scale in fp16, codes rounded half to even) and packed (eight codes of `b`
  bits are `b` bytes) into the codes' room. Specification: `reference.encode_latent_into` (the same bytes but where
  the fp32 products' order moves a value across a rounding boundary).
- `latent_stream_attention` (two launches): a split kernel over the coded tokens decodes each tile's key latents from
  their packed groups, turns them into keys with the decoder (one group's 32 rows at a time), re-applies RoPE from the
  positions, scores them and folds the tile's value latents into an online softmax, in latent space, then applies the
  value decoder once to what it summed (and the mean, by the softmax's weight); the merge combines the splits, folds in
  the raw sinks and window, and normalises. A token's latent codes serve all its kv heads, so a split program takes
  every kv head of its token range (`heads_together`: their keys side by side, each query row scored against its own
  head's channels) and reads the codes once; a chunk's rows, or heads too wide to hold, take a program per kv head.
  Specification: `reference.latent_stream_attention` (one query per head, or a chunk of up to 64).

Group parameters (depths, byte offsets, scale columns) are compile-time tuples: a layer's depths are fixed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant.bitpack import GROUP
from ..layout import LatentCoder, LatentStream, RopeAngles
from .common import (
    EXACT,
    FP16_MAX,
    mask_strides,
    on_device,
    program,
    programs,
    query_rows,
    query_rows_at,
    query_strides,
    rope_cos_sin,
    round_half_even,
    rows_of,
    saturate_fp16,
    turned_cos_sin,
    visible,
)

TILE_TOKENS = 16  # coded tokens a program decodes and scores at a time
TOKENS_PER_SPLIT = 256  # a split's share of the coded tokens at least (fewer splits at short contexts)
MAX_SPLITS = 64
HELD_LATENTS = 4096  # fp32 value latents (query rows x stored components) a split program of several heads holds
HELD_CHANNELS = 256  # key channels (heads x head_dim) a split program of several heads rebuilds a tile of
ENCODE_ROWS = 16  # tokens a program of the encoder codes
LATENT = tl.constexpr(GROUP)  # components of a latent group (the kernels' name for `quant.bitpack.GROUP`)


def groups_of(bits: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Of the stored latent groups (keys' then values'): depth, first byte in a token's codes, their stream (0: keys,
    1: values), their first component among the stream's stored ones."""
    half = len(bits) // 2
    depths, starts, streams, firsts = [], [], [], []
    start, seen = 0, [0, 0]
    for g, b in enumerate(bits):
        if b:
            stream = int(g >= half)
            depths.append(b)
            starts.append(start)
            streams.append(stream)
            firsts.append(seen[stream])
            start += GROUP * b // 8
            seen[stream] += GROUP
    return tuple(depths), tuple(starts), tuple(streams), tuple(firsts)


@triton.jit(do_not_specialize=("at", "n"))
def _raw_rows_kernel(
    k_ptr, v_ptr, kd_ptr, vd_ptr, heads, at, n,
    skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, seb, seh, set_,
    D: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, SATURATE: tl.constexpr,
):  # fmt: skip
    tile, bh = program(0), program(1)
    b, h = bh // heads, bh % heads
    t = tile * ROWS + tl.arange(0, ROWS)[:, None]
    live = t < n
    e, ev = tl.arange(0, D)[None, :], tl.arange(0, DV)[None, :]
    key = tl.load(k_ptr + b * skb + h * skh + t * skt + e, mask=live, other=0.0)
    value = tl.load(v_ptr + b * svb + h * svh + t * svt + ev, mask=live, other=0.0)
    if SATURATE:
        key, value = saturate_fp16(key.to(tl.float32)), saturate_fp16(value.to(tl.float32))
    tl.store(kd_ptr + b * sdb + h * sdh + (at + t) * sdt + e, key.to(kd_ptr.dtype.element_ty), mask=live)
    tl.store(vd_ptr + b * seb + h * seh + (at + t) * set_ + ev, value.to(vd_ptr.dtype.element_ty), mask=live)


def _pow2(n: int) -> bool:
    return n >= 16 and not n & (n - 1)


def serves_raw(keys: torch.Tensor, values: torch.Tensor, key_target: torch.Tensor) -> bool:
    """Power-of-two widths of at least 16 and contiguous rows; the tokens' dtype the target's or wider (fp32 into
    fp16: saturated)."""
    same = keys.dtype == key_target.dtype or (keys.dtype == torch.float32 and key_target.dtype == torch.float16)
    return _pow2(keys.shape[-1]) and _pow2(values.shape[-1]) and keys.stride(-1) == values.stride(-1) == 1 and same


def write_raw(keys: torch.Tensor, values: torch.Tensor, key_target: torch.Tensor, value_target: torch.Tensor,
              at: int) -> None:  # fmt: skip
    """New tokens `[batch, heads, n, dim]` into rows `at...` of the targets (in their dtype: fp16 saturating)."""
    batch, heads, n, dim = keys.shape
    rows = min(triton.next_power_of_2(max(n, 1)), 16)
    on_device(_raw_rows_kernel)[(max(triton.cdiv(n, rows), 1), batch * heads)](
        keys, values, key_target, value_target, heads, at, n,
        *keys.stride()[:3], *values.stride()[:3], *key_target.stride()[:3], *value_target.stride()[:3],
        D=dim, DV=values.shape[-1], ROWS=rows, SATURATE=key_target.dtype == torch.float16,
    )  # fmt: skip


@triton.jit
def _encoder_chunk(k_ptr, v_ptr, pos_ptr, freq_ptr, order_ptr, mean_ptr, enc_ptr, width, first, b, t, live, s0,
                   skb, skh, skt, svb, svh, svt, sxb, sxt, KEYS: tl.constexpr, D: tl.constexpr, SC: tl.constexpr,
                   ROPE: tl.constexpr, ORDER: tl.constexpr):  # fmt: skip
    """Channels `s0...s0 + SC` of the tokens `t` (heads concatenated; keys turned back by their RoPE into the canonical
    order) less the mean, `[ROWS, SC]`, and the encoder's rows of those channels for one group's columns from `first`
    on, `[SC, LATENT]`."""
    s = s0 + tl.arange(0, SC)
    h, cc = s // D, s % D
    half: tl.constexpr = D // 2
    if KEYS:
        c = cc % half
        if ORDER:
            lo_at, hi_at = tl.load(order_ptr + c), tl.load(order_ptr + half + c)
        else:
            lo_at, hi_at = c, c + half
        row = k_ptr + b * skb + h[None, :] * skh + t[:, None] * skt
        a = tl.load(row + lo_at[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        z = tl.load(row + hi_at[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        if ROPE:  # rotate_pairs(x, cos, -sin)
            cos, sin = rope_cos_sin(tl.load(pos_ptr + b * sxb + t * sxt, mask=live, other=0)[:, None],
                                    tl.load(freq_ptr + c)[None, :])  # fmt: skip
            x = tl.where((cc < half)[None, :], a * cos + z * sin, z * cos - a * sin)
        else:
            x = tl.where((cc < half)[None, :], a, z)
    else:
        x = tl.load(v_ptr + b * svb + h[None, :] * svh + t[:, None] * svt + cc[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
    x = x - tl.load(mean_ptr + s)[None, :]
    return x, tl.load(enc_ptr + s[:, None] * width + first + tl.arange(0, LATENT)[None, :])


@triton.jit(do_not_specialize=("n", "tiles", "at"))
def _encode_kernel(
    k_ptr, v_ptr, pos_ptr, freq_ptr, order_ptr, kmean_ptr, vmean_ptr, kenc_ptr, venc_ptr, codes_ptr, scales_ptr,
    n, tiles, at, key_width, value_width,
    skb, skh, skt, svb, svh, svt, sxb, sxt, scb, sct, ssb, sst,
    WIDTH: tl.constexpr, D: tl.constexpr, SC: tl.constexpr, ROWS: tl.constexpr, DEPTHS: tl.constexpr,
    STARTS: tl.constexpr, STREAMS: tl.constexpr, FIRSTS: tl.constexpr, ROPE: tl.constexpr, ORDER: tl.constexpr,
):  # fmt: skip
    pid, group = program(0), program(1)
    b, tile = pid // tiles, pid % tiles
    t = tile * ROWS + tl.arange(0, ROWS)
    live = t < n
    for i in tl.static_range(len(DEPTHS)):  # (the program's group: a compile-time branch each)
        if group == i:
            latent = tl.zeros((ROWS, LATENT), tl.float32)
            for s0 in range(0, WIDTH, SC):  # the encoder's product, SC channels at a time
                if STREAMS[i] == 0:
                    x, w = _encoder_chunk(k_ptr, v_ptr, pos_ptr, freq_ptr, order_ptr, kmean_ptr, kenc_ptr, key_width,
                                          FIRSTS[i], b, t, live, s0, skb, skh, skt, svb, svh, svt, sxb, sxt, True, D,
                                          SC, ROPE, ORDER)  # fmt: skip
                else:
                    x, w = _encoder_chunk(k_ptr, v_ptr, pos_ptr, freq_ptr, order_ptr, vmean_ptr, venc_ptr,
                                          value_width, FIRSTS[i], b, t, live, s0, skb, skh, skt, svb, svh, svt, sxb,
                                          sxt, False, D, SC, ROPE, ORDER)  # fmt: skip
                latent += tl.dot(x, w, input_precision="ieee")
            bits: tl.constexpr = DEPTHS[i]
            qmax: tl.constexpr = (1 << (bits - 1)) - 1
            scale = tl.minimum(tl.math.div_rn(tl.max(tl.abs(latent), axis=1), tl.full((ROWS,), qmax, tl.float32)),
                               FP16_MAX)  # fmt: skip
            nan = tl.max((latent != latent).to(tl.int32), axis=1) > 0  # (tl.max skips NaN; the reference's amax not)
            scale = tl.where(nan, float("nan"), scale).to(tl.float16)
            d = scale.to(tl.float32)
            inverse = tl.where(d > 0, tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), tl.where(d > 0, d, 1.0)), 0.0)
            q = round_half_even(latent * inverse[:, None])
            codes = (tl.minimum(tl.maximum(q, -qmax), qmax) + qmax).to(tl.int64)
            # eight codes of `bits` bits are `bits` bytes: code m of a chunk at bit m * bits (quant.bitpack.pack_bits)
            chunk = tl.sum(tl.reshape(codes, (ROWS, LATENT // 8, 8)) << (tl.arange(0, 8) * bits)[None, None, :], axis=2)
            r = tl.arange(0, 8)
            out = ((chunk[:, :, None] >> (8 * r)[None, None, :]) & 255).to(tl.uint8)  # [ROWS, 4, 8]: byte r
            place = tl.arange(0, LATENT // 8)[None, :, None] * bits + r[None, None, :] + STARTS[i]
            token = codes_ptr + b * scb + (at + t)[:, None, None] * sct
            tl.store(token + place, out, mask=live[:, None, None] & (r < bits)[None, None, :])
            tl.store(scales_ptr + b * ssb + (at + t) * sst + i, scale, mask=live)


def serves_encode(keys: torch.Tensor, target: LatentStream) -> bool:
    """Heads of a power-of-two width of at least 16 (a matrix product's operand), the rows of the codes and scales
    contiguous."""
    dim = keys.shape[-1]
    return _pow2(dim) and target.codes.stride(-1) == target.scales.stride(-1) == 1


def encode_latent_into(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor | None,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    coder: LatentCoder,
    bits: tuple[int, ...],
    target: LatentStream,
    at: int,
) -> None:
    """`reference.encode_latent_into` (see there) in one launch; `freqs` float64 and `order` on the keys' device."""
    batch, heads, n, dim = keys.shape
    if not n:
        return
    depths, starts, streams, firsts = groups_of(bits)
    tiles = triton.cdiv(n, ENCODE_ROWS)
    rope = freqs is not None
    pos = positions if rope else keys
    on_device(_encode_kernel)[(batch * tiles, len(depths))](
        keys, values, pos, freqs if rope else keys, order if order is not None else keys, coder.key_mean,
        coder.value_mean, coder.key_encoder, coder.value_encoder, target.codes, target.scales,
        n, tiles, at, coder.key_encoder.shape[1], coder.value_encoder.shape[1],
        *keys.stride()[:3], *values.stride()[:3], pos.stride(0), pos.stride(-1), target.codes.stride(0),
        target.codes.stride(1), target.scales.stride(0), target.scales.stride(1),
        WIDTH=heads * dim, D=dim, SC=min(dim, 64), ROWS=ENCODE_ROWS, DEPTHS=depths,
        STARTS=starts, STREAMS=streams, FIRSTS=firsts, ROPE=rope, ORDER=order is not None, **EXACT,
    )  # fmt: skip


@triton.jit
def _group_latent(token_codes, token_scales, valid, BITS: tl.constexpr, START: tl.constexpr, SCALE_AT: tl.constexpr):
    """fp32 `[T, LATENT]` latent components of one stored group of tokens whose codes start at `token_codes` (`[T, 1]`
    pointers) and scales at `token_scales` (`[T]`): `(code - qmax) * scale` (`reference.dequantize_latent`)."""
    j = tl.arange(0, LATENT)[None, :]
    bit = j * BITS
    at = token_codes + START + bit // 8
    shift = bit % 8
    word = tl.load(at, mask=valid[:, None], other=0).to(tl.int32)
    word = word | (tl.load(at + 1, mask=valid[:, None] & (shift + BITS > 8), other=0).to(tl.int32) << 8)
    code = (word >> shift) & ((1 << BITS) - 1)
    qmax: tl.constexpr = (1 << (BITS - 1)) - 1
    scale = tl.load(token_scales + SCALE_AT, mask=valid, other=0.0).to(tl.float32)
    return (code - qmax).to(tl.float32) * scale[:, None]


@triton.jit
def _value_columns(LV: tl.constexpr, DEPTHS: tl.constexpr, STARTS: tl.constexpr, STREAMS: tl.constexpr,
                   FIRSTS: tl.constexpr):  # fmt: skip
    """Of the value latents' `LV` columns (stored groups side by side, padding after): each one's depth (0: padding),
    its group's first byte in a token's codes, and its group's scale column."""
    column = tl.arange(0, LV)
    depth = tl.zeros((LV,), tl.int32)
    start = tl.zeros((LV,), tl.int32)
    scale_at = tl.zeros((LV,), tl.int32)
    for i in tl.static_range(len(DEPTHS)):
        if STREAMS[i] == 1:
            mine = column // LATENT == FIRSTS[i] // LATENT
            depth = tl.where(mine, DEPTHS[i], depth)
            start = tl.where(mine, STARTS[i], start)
            scale_at = tl.where(mine, i, scale_at)
    return depth, start, scale_at


@triton.jit
def _value_latents(token_codes, token_scales, valid, depth, start, scale_at, LV: tl.constexpr):
    """fp32 `[T, LV]` value latents of a tile of tokens (`_group_latent` of every stored value group at once; zeros in
    the padding columns)."""
    j = tl.arange(0, LV) % LATENT
    bit = j * depth
    at = token_codes + (start + bit // 8)[None, :]
    shift = (bit % 8)[None, :]
    live = valid[:, None] & (depth > 0)[None, :]
    word = tl.load(at, mask=live, other=0).to(tl.int32)
    word = word | (tl.load(at + 1, mask=live & (shift + depth[None, :] > 8), other=0).to(tl.int32) << 8)
    code = (word >> shift) & ((1 << depth[None, :]) - 1)
    qmax = (1 << tl.maximum(depth - 1, 0)) - 1
    scale = tl.load(token_scales[:, None] + scale_at[None, :], mask=live, other=0.0).to(tl.float32)
    return (code - qmax[None, :]).to(tl.float32) * scale


@triton.jit(do_not_specialize=("length", "coded_column", "per_split", "causal_offset", "head_rows", "GROUP_Q", "NQ"))
def _latent_split_kernel(
    q_ptr, codes_ptr, scales_ptr, kdec_ptr, kmean_ptr, vdec_ptr, vmean_ptr, pos_ptr, freq_ptr, order_ptr, mask_ptr,
    o_ptr, m_ptr, l_ptr, heads, length, coded_column, per_split, scale, stream_width, causal_offset, head_rows,
    sqb, sqh, sqg, sqi, scb, sct, ssb, sst, sxb, sxt, smb, smq, smt,
    GROUP_Q, G_PAD: tl.constexpr, HP: tl.constexpr, HP_PAD: tl.constexpr, D: tl.constexpr,
    T: tl.constexpr, NV: tl.constexpr, NV_PAD: tl.constexpr, DEPTHS: tl.constexpr, STARTS: tl.constexpr,
    STREAMS: tl.constexpr, FIRSTS: tl.constexpr, ROPE: tl.constexpr, ORDER: tl.constexpr, MASK: tl.constexpr,
    NQ, ONE: tl.constexpr,
):  # fmt: skip
    LV: tl.constexpr = NV_PAD * LATENT
    pid, split = program(0), program(1)
    n_splits = programs(1)
    b, h0 = pid // (heads // HP), (pid % (heads // HP)) * HP  # the program's kv heads: h0...h0 + HP
    half: tl.constexpr = D // 2
    # this block's query rows over the program's heads: row r is row g = r % GROUP_Q (query g % NQ of query head
    # g // NQ) of kv head h0 + r // GROUP_Q
    r = program(2) * G_PAD + tl.arange(0, G_PAD)
    mine, g = r // GROUP_Q, r % GROUP_Q
    live = r < HP * GROUP_Q
    # the program's heads side by side: column x is channel pair c = x % half of head h0 + x // half
    x = tl.arange(0, HP_PAD * half)
    x_head, c = x // half, x % half
    x_live = x_head < HP
    j = tl.arange(0, LATENT)
    if ORDER:  # the coded keys are canonical: so are the queries that meet them
        lo_at, hi_at = tl.load(order_ptr + c), tl.load(order_ptr + half + c)
    else:
        lo_at, hi_at = c, c + half
    # each row's query in its head's columns, zeros in the others'
    rows = query_rows_at(q_ptr, b, (h0 + mine)[:, None], g, sqb, sqh, sqg, sqi, NQ)
    own = live[:, None] & (x_head[None, :] == mine[:, None])
    q_lo = tl.load(rows + lo_at[None, :], mask=own, other=0.0).to(tl.float32)
    q_hi = tl.load(rows + hi_at[None, :], mask=own, other=0.0).to(tl.float32)
    freqs = tl.load(freq_ptr + c) if ROPE else tl.zeros((HP_PAD * half,), tl.float64)
    columns = (h0 + x_head) * D + c  # the heads' first halves in the stream
    mean_lo = tl.load(kmean_ptr + columns, mask=x_live, other=0.0)
    mean_hi = tl.load(kmean_ptr + columns + half, mask=x_live, other=0.0)
    depth, start_byte, scale_at = _value_columns(LV, DEPTHS, STARTS, STREAMS, FIRSTS)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, NV_PAD, LATENT), tl.float32)  # the value latents the softmax weights summed, by group
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    for t0 in range(start, end, T):
        tok = t0 + tl.arange(0, T)
        valid = tok < end
        if MASK and ONE:
            valid = valid & (tl.load(mask_ptr + b * smb + (coded_column + tok) * smt, mask=valid, other=0) != 0)
        token_codes = codes_ptr + b * scb + tok[:, None] * sct
        token_scales = scales_ptr + b * ssb + tok * sst
        k_lo = tl.zeros((T, HP_PAD * half), tl.float32) + mean_lo[None, :]
        k_hi = tl.zeros((T, HP_PAD * half), tl.float32) + mean_hi[None, :]
        for i in tl.static_range(len(DEPTHS)):  # keys: each stored group times its 32 rows of the decoder
            if STREAMS[i] == 0:
                z = _group_latent(token_codes, token_scales, valid, DEPTHS[i], STARTS[i], i)
                row = kdec_ptr + (j + FIRSTS[i])[:, None] * stream_width + columns[None, :]
                w_lo = tl.load(row, mask=x_live[None, :], other=0.0).to(tl.float32)
                w_hi = tl.load(row + half, mask=x_live[None, :], other=0.0).to(tl.float32)
                k_lo += tl.dot(z, w_lo, input_precision="ieee")
                k_hi += tl.dot(z, w_hi, input_precision="ieee")
        if ROPE:
            pos = tl.load(pos_ptr + b * sxb + tok * sxt, mask=valid, other=0)
            cos, sin = turned_cos_sin(pos[:, None], freqs[None, :])
            k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
        scores = (tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
                  + tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")) * scale  # fmt: skip
        if ONE:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        else:  # several queries (a chunk): each row's mask row, or its causal limit
            seen = visible(valid, coded_column + tok, g % NQ, b, mask_ptr, smb, smq, smt, causal_offset, MASK)
            scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        z = _value_latents(token_codes, token_scales, valid, depth, start_byte, scale_at, LV)
        acc = acc * alpha[:, None, None] + tl.reshape(tl.dot(p, z, input_precision="ieee"), (G_PAD, NV_PAD, LATENT))
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    # the value decoder once per split: sum_t p_t (z_t D + mean) = (sum_t p_t z_t) D + mean sum_t p_t, by group; each
    # row takes its own head's columns of the product with every head's
    e = tl.arange(0, D)
    slots = tl.arange(0, NV_PAD)
    y = tl.arange(0, HP_PAD * D)
    y_head = y // D
    values = l_i[:, None] * tl.load(vmean_ptr + (h0 + mine)[:, None] * D + e[None, :], mask=live[:, None], other=0.0)
    decoded = tl.zeros((G_PAD, HP_PAD * D), tl.float32)
    for i in tl.static_range(NV):
        latents = tl.sum(tl.where((slots == i)[None, :, None], acc, 0.0), axis=1)  # [G_PAD, LATENT]
        weights = tl.load(vdec_ptr + (j + i * LATENT)[:, None] * stream_width + (h0 * D + y)[None, :],
                          mask=(y_head < HP)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        decoded += tl.dot(latents, weights, input_precision="ieee")
    decoded = tl.reshape(decoded, (G_PAD, HP_PAD, D))
    values += tl.sum(tl.where((tl.arange(0, HP_PAD) == mine[:, None])[:, :, None], decoded, 0.0), axis=1)
    out = ((b * heads + h0 + mine) * n_splits + split) * head_rows + g
    tl.store(o_ptr + out[:, None] * D + e[None, :], values, mask=live[:, None])
    tl.store(m_ptr + out, m_i, mask=live)
    tl.store(l_ptr + out, l_i, mask=live)


@triton.jit
def _fold_raw(q, key, value, column, m_i, l_i, acc, b, g, mask_ptr, smb, smq, smt, causal_offset, scale,
              MASK: tl.constexpr, NQ, ONE: tl.constexpr):  # fmt: skip
    """One raw token (`key`, `value` `[D]`, at mask column `column`) folded into query rows `g`' running
    statistics."""
    score = tl.sum(q * key.to(tl.float32)[None, :], axis=1) * scale
    if not ONE:  # each query row's mask row, or its causal limit
        at = tl.full((1,), column, tl.int32)
        seen = visible(at == at, at, g % NQ, b, mask_ptr, smb, smq, smt, causal_offset, MASK)
        score = tl.where(tl.reshape(seen, (g.shape[0],)), score, float("-inf"))
    elif MASK:
        score = tl.where(tl.load(mask_ptr + b * smb + column * smt) != 0, score, float("-inf"))
    m_new = tl.maximum(m_i, score)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha, p = tl.exp(m_i - m_safe), tl.exp(score - m_safe)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * value.to(tl.float32)[None, :]


@triton.jit(do_not_specialize=("n_splits", "window", "window_column", "causal_offset", "GROUP_Q", "NQ"))
def _latent_merge_kernel(
    q_ptr, o_ptr, m_ptr, l_ptr, sk_ptr, sv_ptr, wk_ptr, wv_ptr, mask_ptr, out_ptr,
    heads, n_splits, sinks, window, window_column, scale, causal_offset,
    sqb, sqh, sqg, sqi, skb, skh, skt, svb, svh, svt, swb, swh, swt, sub, suh, sut, smb, smq, smt,
    GROUP_Q, G_PAD: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr, NQ, ONE: tl.constexpr,
):  # fmt: skip
    bh = program(0)
    b, h = bh // heads, bh % heads
    g = program(1) * G_PAD + tl.arange(0, G_PAD)  # this block's query rows (see the split kernel)
    r_pad = programs(1) * G_PAD
    e = tl.arange(0, D)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    live = g < GROUP_Q  # (the splits write no padding row)
    for s in range(n_splits):  # the splits, by log-sum-exp
        at = (bh * n_splits + s) * r_pad + g
        m_s = tl.load(m_ptr + at, mask=live, other=float("-inf"))
        l_s = tl.load(l_ptr + at, mask=live, other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        mine, theirs = tl.exp(m_i - m_safe), tl.exp(m_s - m_safe)
        l_i = l_i * mine + l_s * theirs
        split = tl.load(o_ptr + at[:, None] * D + e[None, :], mask=live[:, None], other=0.0)
        acc = acc * mine[:, None] + split * theirs[:, None]
        m_i = m_new
    q = tl.load(query_rows_at(q_ptr, b, h, g, sqb, sqh, sqg, sqi, NQ) + e[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    for t in range(sinks):
        key = tl.load(sk_ptr + b * skb + h * skh + t * skt + e)
        value = tl.load(sv_ptr + b * svb + h * svh + t * svt + e)
        m_i, l_i, acc = _fold_raw(q, key, value, t, m_i, l_i, acc, b, g, mask_ptr, smb, smq, smt, causal_offset,
                                  scale, MASK, NQ, ONE)  # fmt: skip
    for t in range(window):
        key = tl.load(wk_ptr + b * swb + h * swh + t * swt + e)
        value = tl.load(wv_ptr + b * sub + h * suh + t * sut + e)
        m_i, l_i, acc = _fold_raw(q, key, value, window_column + t, m_i, l_i, acc, b, g, mask_ptr, smb, smq, smt,
                                  causal_offset, scale, MASK, NQ, ONE)  # fmt: skip
    out = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]  # nothing seen gives zeros
    tl.store(out_ptr + (bh * GROUP_Q + g[:, None]) * D + e[None, :], out, mask=live[:, None])


def heads_together(heads: int, group: int, n_queries: int, value_groups: int, dim: int) -> int:
    """kv heads one split program serves (a divisor of `heads`): every one a single query's program holds (their
    tokens' latent codes, shared by the heads, are then read once, not once per head) while its rows' value latents
    (rows padded to 16, the matrix product's least height) stay within `HELD_LATENTS` and the heads' key channels
    within `HELD_CHANNELS`; one for a chunk (its rows fill a program)."""
    if n_queries > 1:
        return 1
    latents = triton.next_power_of_2(max(value_groups, 1)) * GROUP
    fits = [n for n in range(1, heads + 1) if not heads % n and triton.next_power_of_2(n) * dim <= HELD_CHANNELS
            and max(triton.next_power_of_2(n * group), 16) * latents <= HELD_LATENTS]  # fmt: skip
    return max(fits, default=1)


def supports(query: torch.Tensor, stream: LatentStream, raw: list, mask: torch.Tensor | None, n_queries: int = 1
             ) -> bool:  # fmt: skip
    """One power-of-two head width of 32-256 (a key half is a matrix product's operand), the rows of the codes, the
    scales and every raw part contiguous; up to `common.MAX_QUERIES` queries, a mask of a row each."""
    dim = query.shape[-1]
    if dim < 32 or dim > 256 or dim & (dim - 1) or not rows_of(mask, n_queries):
        return False
    tensors = [stream.codes, stream.scales, *[t for keys, values, _ in raw for t in (keys, values)]]
    return all(t.stride(-1) == 1 for t in tensors)


def latent_stream_attention(
    query: torch.Tensor,
    raw: list[tuple[torch.Tensor, torch.Tensor, int]],
    stream: LatentStream,
    coder: LatentCoder,
    rope: RopeAngles | None,
    order: torch.Tensor | None,
    coded_column: int,
    mask: torch.Tensor | None,
    scale: float,
    n_queries: int = 1,
    causal_offset: int = 0,
) -> torch.Tensor:
    """`reference.latent_stream_attention` (see `supports`): fp32 `[batch, kv_heads, rows, dim]`, row
    `g * n_queries + i` query `i` of the kv head's `g`-th query head. `raw`: the sinks, then the window (keys after
    RoPE, model order), each with its first mask column; `rope.freqs` float64 and `order` on the queries' device;
    `mask` bool `[batch, n_queries, columns]`, or None: causal, query `i` sees columns up to `causal_offset + i`."""
    strides, group = query_strides(query, n_queries)
    batch, heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    device = query.device
    (sink_keys, sink_values, _), (window_keys, window_values, window_column) = raw
    rows = query_rows(group, n_queries, causal_offset)
    g_pad, padded = rows.block, rows.block * rows.blocks
    value_groups = coder.value_decoder.shape[0] // GROUP
    nv_pad = triton.next_power_of_2(max(value_groups, 1))
    length = stream.length
    together = heads_together(heads, group, n_queries, value_groups, dim)
    # the split programs' rows: a block of at least 16 (their products are matrix products)
    block = max(triton.next_power_of_2(together * group) if n_queries == 1 else rows.block, 16)
    split_blocks = triton.cdiv(together * group, block)
    # a program of `together` heads takes as many tokens as one of a head: each split program reads the queries and
    # writes its partials, the same bytes for fewer tokens would be read over again
    splits = min(MAX_SPLITS, triton.cdiv(length, TOKENS_PER_SPLIT))
    per_split = triton.cdiv(triton.cdiv(length, splits), TILE_TOKENS) * TILE_TOKENS if splits else 0
    splits = triton.cdiv(length, per_split) if splits else 0
    o = torch.empty(batch * heads, splits, padded, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * heads, splits, padded, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    mask_rows = mask if mask is not None else query
    stream_width = coder.key_mean.shape[0]
    if splits:
        depths, starts, streams, firsts = groups_of(stream.bits)
        positions = rope.positions if rope is not None else query
        on_device(_latent_split_kernel)[(batch * heads // together, splits, split_blocks)](
            query, stream.codes, stream.scales, coder.key_decoder, coder.key_mean, coder.value_decoder,
            coder.value_mean, positions, rope.freqs if rope is not None else query,
            order if order is not None else query, mask_rows, o, m, l_sum,
            heads, length, coded_column, per_split, float(scale), stream_width, causal_offset, padded,
            *strides, stream.codes.stride(0), stream.codes.stride(1), stream.scales.stride(0),
            stream.scales.stride(1), positions.stride(0), positions.stride(-1), *mask_strides(mask),
            GROUP_Q=group, G_PAD=block, HP=together, HP_PAD=triton.next_power_of_2(together), D=dim,
            T=TILE_TOKENS, NV=value_groups, NV_PAD=nv_pad, DEPTHS=depths, STARTS=starts, STREAMS=streams,
            FIRSTS=firsts, ROPE=rope is not None, ORDER=order is not None, MASK=mask is not None, NQ=n_queries,
            ONE=n_queries == 1, num_warps=4 if dim * together < 128 else 8,
        )  # fmt: skip
    out = torch.empty(batch, heads, group, dim, dtype=torch.float32, device=device)
    on_device(_latent_merge_kernel)[(batch * heads, rows.blocks)](
        query, o, m, l_sum, sink_keys, sink_values, window_keys, window_values, mask_rows, out,
        heads, splits, sink_keys.shape[2], window_keys.shape[2], window_column, float(scale), causal_offset,
        *strides, *sink_keys.stride()[:3], *sink_values.stride()[:3], *window_keys.stride()[:3],
        *window_values.stride()[:3], *mask_strides(mask),
        GROUP_Q=group, G_PAD=g_pad, D=dim, MASK=mask is not None, NQ=n_queries, ONE=n_queries == 1,
        num_warps=4 if dim < 256 else 8,
    )  # fmt: skip
    return out
