"""Triton kernels: decoding attention straight from plain block-quantized (or fp16) storage, flash-decoding style,
GQA-aware, in two launches. Specification: `reference.stream_attention` over plain streams (one query per head).

`_plain_split_kernel`, grid (batch × kv heads, splits): a program loads the queries of every query head sharing its kv
head (each packed byte is read by one program), walks its share of the tokens `T` at a time, decodes the tile's keys
and values in registers (`load_rows`: q4_0, q4_1, q8_0, q3_0, f16 and the 16-wide variants, keys and values each in
its own format; storage read through its strides, never copied), scores and folds them into an online softmax and
stores its running statistics. Rotated keys are met by rotating the queries once (q . H s == (H q) . s, butterflies);
keys stored before RoPE get it back from their positions (every angle of the tile, `common.turned_cos_sin`), after
their rotation is undone when they have one. The merge is the adaptive keys' (`adaptive_attention.merge_splits`):
splits by log-sum-exp, the values' rotation undone once, the raw sinks folded in, the output normalised.
`_load_tile` and the split helpers below also serve `delta_attention.py`. Plain `tl` operations only, so the same
kernels serve NVIDIA and AMD GPUs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Kind, QuantizedTensor
from ..hadamard import rotation_scale
from ..layout import ChannelStream, PlainStream, RopeAngles
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
    saturate_fp16,
    turn_rows,
    visible,
)

ROW_KINDS = (*TILE_KINDS, Kind.Q3_SYM, Kind.F16)  # what `load_rows` decodes
F16, Q4_SYM, Q4_ASYM, Q8, Q3_SYM = (tl.constexpr(int(k)) for k in (Kind.F16, Kind.Q4_SYM, Kind.Q4_ASYM, Kind.Q8,
                                                                   Kind.Q3_SYM))  # fmt: skip
TOKENS_PER_SPLIT = 256  # a split's share of the stream at least (fewer splits at short contexts)
MAX_SPLITS = 64


@triton.jit
def dequantize_elements(block, scale_at, min_at, within, live, BS: tl.constexpr, KIND: tl.constexpr):
    """fp32 values of block-quantized elements, as `quant.dequantize` computes them: `block` points at the first code
    byte of each element's block, `scale_at` (and `min_at`, q4_1) at its scale, `within` is the element's place in
    its block; elements not `live` read as zeros. q8_0's codes pointer is int8. (Not f16: it has no blocks.)"""
    s = tl.load(scale_at, mask=live, other=0.0).to(tl.float32)
    # One branch per kind and a single return: the GPU front end compiles the code after an early return too.
    if KIND == Q8:
        out = tl.load(block + within, mask=live, other=0).to(tl.float32) * s
    elif KIND == Q3_SYM:  # `pack_3bit`: 2 low bits of codes j, j+8, j+16, j+24 in byte j; high bits in bytes 8-11
        low = tl.load(block + within % 8, mask=live, other=0)
        high = tl.load(block + 8 + within // 8, mask=live, other=0)
        code = ((low >> ((within // 8) * 2)) & 3) | (((high >> (within % 8)) & 1) << 2)
        out = (code.to(tl.float32) - 4.0) * s
    else:  # 4-bit: byte j holds code j (low nibble) and code j + BS/2 (high)
        half: tl.constexpr = BS // 2
        packed = tl.load(block + within % half, mask=live, other=0)
        code = ((packed >> ((within // half) * 4)) & 0x0F).to(tl.float32)
        if KIND == Q4_ASYM:
            out = code * s + tl.load(min_at, mask=live, other=0.0).to(tl.float32)
        else:
            out = (code - 8.0) * s
    return out


@triton.jit
def load_rows(codes_ptr, scales_ptr, mins_ptr, tok, valid, sct, sst, D: tl.constexpr, BS: tl.constexpr,
              KIND: tl.constexpr):  # fmt: skip
    """Dequantized fp32 `[len(tok), D]` rows `tok` of one head's plain storage (`codes_ptr`, `scales_ptr`, `mins_ptr`
    at the head; `sct`, `sst`: the token strides of codes and scales; each token's blocks contiguous), as
    `quant.dequantize` computes them; rows past `valid` read as zeros. q8_0's codes pointer is int8."""
    e = tl.arange(0, D)[None, :]
    row = tok[:, None]
    live = valid[:, None]
    if KIND == F16:
        rows = tl.load(codes_ptr + row * sct + e, mask=live, other=0.0).to(tl.float32)
    else:
        block_bytes: tl.constexpr = BS if KIND == Q8 else BS * 3 // 8 if KIND == Q3_SYM else BS // 2
        blk = e // BS
        scale_at = row * sst + blk
        rows = dequantize_elements(codes_ptr + row * sct + blk * block_bytes, scales_ptr + scale_at,
                                   mins_ptr + scale_at, e % BS, live, BS, KIND)  # fmt: skip
    return rows


@triton.jit
def load_channel_rows(codes_ptr, scales_ptr, mins_ptr, tail_ptr, tok, valid, coded, sgt, sgd, sst, ssd, stt,
                      D: tl.constexpr, BS: tl.constexpr, KIND: tl.constexpr):  # fmt: skip
    """fp32 `[len(tok), D]` keys `tok` of one head's KIVI-style stream (`reference.decode_channel`): tokens before
    `coded` from their group's per-channel blocks (`sgt`, `sgd`: the group and channel strides of the codes; `sst`,
    `ssd`: of the scales and mins), dequantized and rounded to fp16 as the reference decodes them; later ones from
    the fp16 tail (`stt`: its token stride). Rows past `valid` read as zeros."""
    e = tl.arange(0, D)[None, :]
    row = tok[:, None]
    grouped = valid[:, None] & (row < coded)
    scale_at = (row // BS) * sst + e * ssd
    coded_rows = dequantize_elements(codes_ptr + (row // BS) * sgt + e * sgd, scales_ptr + scale_at,
                                     mins_ptr + scale_at, row % BS, grouped, BS, KIND)  # fmt: skip
    coded_rows = saturate_fp16(coded_rows).to(tl.float16).to(tl.float32)
    raw = tl.load(tail_ptr + (row - coded) * stt + e, mask=valid[:, None] & (row >= coded), other=0.0)
    return tl.where(row < coded, coded_rows, raw.to(tl.float32))


@triton.jit
def _load_tile(
    codes_ptr,
    scales_ptr,
    mins_ptr,
    tok,
    valid,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    ASYM: tl.constexpr,
):
    """`load_rows` of a contiguous head of a q4_0, q4_1 or q8_0 family stream."""
    if BITS == 8:
        return load_rows(codes_ptr, scales_ptr, mins_ptr, tok, valid, D, D // BLOCK, D, BLOCK, Q8)
    if ASYM:
        return load_rows(codes_ptr, scales_ptr, mins_ptr, tok, valid, D // 2, D // BLOCK, D, BLOCK, Q4_ASYM)
    return load_rows(codes_ptr, scales_ptr, mins_ptr, tok, valid, D // 2, D // BLOCK, D, BLOCK, Q4_SYM)


@triton.jit
def store_partials(o_ptr, m_ptr, l_ptr, bh, split, n_splits, acc, m_i, l_i, G_PAD: tl.constexpr, D: tl.constexpr):
    """One split's running statistics of its block of `G_PAD` query rows (grid axis 2: the blocks, one without it),
    combined afterwards by `combine_splits` or the merge kernel."""
    out = (bh * n_splits + split) * (programs(2) * G_PAD) + program(2) * G_PAD + tl.arange(0, G_PAD)
    tl.store(o_ptr + out[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit
def fold_tile(scores, v, m_i, l_i, acc):
    """Fold one tile (scores `[G_PAD, T]`, values `[T, D]`) into the running max, sum and weighted values."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


def combine_splits(o: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor):
    """Merge per-split statistics (`o [rows, splits, G, D]`, `m` and `l_sum [rows, splits, G]`) by log-sum-exp:
    returns (acc, max, sum) over the splits, acc and sum relative to that max."""
    top = m.amax(dim=1, keepdim=True)
    weight = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - top))
    return (o * weight[..., None]).sum(1), top.squeeze(1), (l_sum * weight).sum(1)


@triton.jit(do_not_specialize=("length", "coded", "tokens_per_split", "first", "causal_offset", "GROUP", "NQ"))
def _plain_split_kernel(
    q_ptr, kc_ptr, ks_ptr, km_ptr, kt_ptr, vc_ptr, vs_ptr, vm_ptr, pos_ptr, freq_ptr, mask_ptr, o_ptr, m_ptr, l_ptr,
    idx_ptr, sc_ptr,
    kv_heads, length, coded, sinks, tokens_per_split, scale, first, causal_offset,
    sqb, sqh, sqg, sqi, skb, skh, skt, skd, ssb, ssh, sst, ssd, stb, sth, stt, svb, svh, svt, swb, swh, swt, sxb,
    sxt, smb, smq, smt, sib, sih,
    GROUP, G_PAD: tl.constexpr, D: tl.constexpr, T: tl.constexpr, K_KIND: tl.constexpr,
    K_BS: tl.constexpr, K_CHANNEL: tl.constexpr, V_KIND: tl.constexpr, V_BS: tl.constexpr, K_STAGES: tl.constexpr,
    K_SCALE: tl.constexpr, ROPE: tl.constexpr, MASK: tl.constexpr, INDEXED: tl.constexpr, SCORES: tl.constexpr,
    NQ, ONE: tl.constexpr,
):  # fmt: skip
    bh, split = program(0), program(1)
    n_splits = programs(1)
    b, h = bh // kv_heads, bh % kv_heads
    half: tl.constexpr = D // 2
    g = program(2) * G_PAD + tl.arange(0, G_PAD)  # this block's query rows: query g % NQ of head g // NQ
    q = tl.load(query_rows_at(q_ptr, b, h, g, sqb, sqh, sqg, sqi, NQ) + tl.arange(0, D)[None, :],
                mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    if K_STAGES > 0 and not ROPE:  # q . (H s) == (H q) . s: the queries turned once instead of every key
        q = butterflies(q, G_PAD, D, K_STAGES, K_SCALE)
    freqs = tl.load(freq_ptr + tl.arange(0, half)) if ROPE else tl.zeros((half,), tl.float64)
    k_codes, k_scales, k_mins = kc_ptr + b * skb + h * skh, ks_ptr + b * ssb + h * ssh, km_ptr + b * ssb + h * ssh
    v_codes, v_scales, v_mins = vc_ptr + b * svb + h * svh, vs_ptr + b * swb + h * swh, vm_ptr + b * swb + h * swh
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    start = first + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, length)
    for t0 in range(start, end, T):
        tok = t0 + tl.arange(0, T)
        valid = tok < end
        if INDEXED:  # slots of kept tokens (`KeptStream`): a token's mask column is its position; -1: evicted
            column = tl.load(idx_ptr + b * sib + h * sih + tok, mask=valid, other=-1)
            valid = valid & (column >= 0)
        else:
            column = sinks + tok
        if MASK and ONE:
            valid = valid & (tl.load(mask_ptr + b * smb + column * smt, mask=valid, other=0) != 0)
        if K_CHANNEL:  # KIVI-style: per-channel blocks of K_BS tokens (a tile lies in one group), then the fp16 tail
            k = load_channel_rows(k_codes, k_scales, k_mins, kt_ptr + b * stb + h * sth, tok, valid, coded, skt, skd,
                                  sst, ssd, stt, D, K_BS, K_KIND)  # fmt: skip
        else:
            k = load_rows(k_codes, k_scales, k_mins, tok, valid, skt, sst, D, K_BS, K_KIND)
        if ROPE:  # stored before RoPE (canonical pairs c, c + D/2): un-rotated first, then turned by its position
            if K_STAGES > 0:
                k = butterflies(k, T, D, K_STAGES, K_SCALE)
            k = turn_rows(k, tl.load(pos_ptr + b * sxb + tok * sxt, mask=valid, other=0), freqs, T, D)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, T]
        if ONE:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        else:  # several queries (a chunk): each row's mask row, or its causal limit
            seen = visible(valid, column, g % NQ, b, mask_ptr, smb, smq, smt, causal_offset, MASK)
            scores = tl.where(seen, scores, float("-inf"))
        if SCORES:  # each query row's scores, for what SnapKV observes (`Observation`)
            at = sc_ptr + (bh * (programs(2) * G_PAD) + g[:, None]) * length + tok[None, :]
            tl.store(at, scores, mask=(tok < end)[None, :])
        v = load_rows(v_codes, v_scales, v_mins, tok, valid, svt, swt, D, V_BS, V_KIND)
        m_i, l_i, acc = fold_tile(scores, v, m_i, l_i, acc)
    store_partials(o_ptr, m_ptr, l_ptr, bh, split, n_splits, acc, m_i, l_i, G_PAD, D)


def _rows_contiguous(q: QuantizedTensor) -> bool:
    """Each token's codes (and scales) contiguous, as `load_rows` reads them."""
    codes = q.codes
    return all(t.stride(-1) == 1 for t in q.tensors()) and (codes.dim() < 5 or codes.stride(-2) == codes.shape[-1])


def supports(keys: PlainStream | ChannelStream, values: PlainStream, mask: torch.Tensor | None, n_queries: int = 1
             ) -> bool:  # fmt: skip
    """Plain values (a format of `ROW_KINDS`, rotated or not) and plain keys (the same, before RoPE or after) or
    KIVI-style keys (per-channel blocks of a block format, not rotated), of one power-of-two head dim of 16-256 tiled
    by the values' (and plain keys') blocks, each token's (each channel's) storage contiguous; a mask of a row per
    query."""
    dim = keys.dim
    if dim != values.dim or dim < 16 or dim > 256 or dim & (dim - 1) or not rows_of(mask, n_queries):
        return False
    if isinstance(keys, ChannelStream):
        if keys.rotation or keys.tail.stride(-1) != 1 or keys.group % tile_tokens(dim):
            return False
        if keys.groups is not None and not (
            keys.groups.fmt.kind in ROW_KINDS
            and keys.groups.fmt.kind != Kind.F16
            and _rows_contiguous(keys.groups)
            and _mins_like_scales(keys.groups)
        ):
            return False
        streams = (values,)
    else:
        streams = (keys, values)
    for stream in streams:
        fmt = stream.blocks.fmt
        if fmt.kind not in ROW_KINDS or dim % fmt.block_size or not _rows_contiguous(stream.blocks):
            return False
        if not _mins_like_scales(stream.blocks):
            return False
    return True


def _mins_like_scales(q: QuantizedTensor) -> bool:
    """The kernels address mins with the scales' strides."""
    return q.mins is None or q.mins.stride() == q.scales.stride()


def split_tokens(tokens: int, tile: int, splits: int | None = None) -> tuple[int, int]:
    """(programs per kv head, tokens each: whole tiles) for a stream of `tokens` (default: one per `TOKENS_PER_SPLIT`
    tokens, at most `MAX_SPLITS`; at least one)."""
    splits = splits or max(1, min(MAX_SPLITS, triton.cdiv(tokens, TOKENS_PER_SPLIT)))
    per_split = triton.cdiv(triton.cdiv(max(tokens, 1), splits), tile) * tile
    return max(1, triton.cdiv(tokens, per_split)), per_split


def tile_tokens(dim: int) -> int:
    """Tokens a program decodes and scores at a time: what keeps a tile's products in registers."""
    return 16 if dim <= 64 else 8 if dim <= 128 else 4


def plain_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: PlainStream | ChannelStream,
    values: PlainStream,
    *,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    scale: float,
    splits: int | None = None,
    n_queries: int = 1,
    causal_offset: int = 0,
) -> torch.Tensor:
    """`reference.stream_attention` over plain values and plain or KIVI-style keys (see `supports`): fp32
    `[batch, kv_heads, rows, dim]`, in two launches.

    Args:
        query: `[batch, kv_heads, rows, dim]` (any float dtype; canonical order with `rope`): row `g * n_queries + i`
            is query `i` of the kv head's `g`-th query head; or `[batch, kv_heads, group, n_queries, dim]`.
        sink_keys, sink_values: `[batch, kv_heads, sinks, dim]`.
        rope: positions `[batch, stream tokens]` and float64 frequencies on the queries' device, or None.
        mask: bool `[batch, n_queries, sinks + stream tokens]` or None: causal, query `i` sees tokens up to
            `causal_offset + i` (sinks counted).
        splits: programs per kv head (default: one per `TOKENS_PER_SPLIT` tokens, at most `MAX_SPLITS`).
    """
    strides, group = query_strides(query, n_queries)
    batch, kv_heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    device = query.device
    tile = tile_tokens(dim)
    rows = query_rows(group, n_queries, causal_offset)
    g_pad, blocks = rows.block, rows.blocks
    n_tokens = keys.length
    splits, per_split = split_tokens(n_tokens, tile, splits)
    o = torch.empty(batch * kv_heads, splits, blocks * g_pad, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * kv_heads, splits, blocks * g_pad, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    channel = isinstance(keys, ChannelStream)
    k = keys.groups if channel else keys.blocks
    k_tail = keys.tail if channel else query  # (plain keys: none read)
    coded = keys.length - k_tail.shape[2] if channel else n_tokens
    v = values.blocks
    if k is None:  # KIVI-style keys all in the tail so far: no group read
        k_codes, k_scales = k_tail.view(torch.uint8), k_tail  # (dummies of the kernel's types)
        k_mins = k_scales
        k_kind, k_block = int(Kind.Q4_SYM), keys.group
    else:
        k_codes = k.codes.view(torch.int8) if k.fmt.kind == Kind.Q8 else k.codes
        k_scales = k.scales if k.scales is not None else k.codes  # (f16: none read)
        k_mins = k.mins if k.mins is not None else k_scales
        k_kind, k_block = int(k.fmt.kind), k.fmt.block_size
    v_codes = v.codes.view(torch.int8) if v.fmt.kind == Kind.Q8 else v.codes
    v_scales = v.scales if v.scales is not None else v.codes
    v_mins = v.mins if v.mins is not None else v_scales
    # strides: plain keys by token; KIVI-style keys by group and channel (codes [B, H, groups, D, 1, bytes])
    k_strides = (*k_codes.stride()[:3], k_codes.stride(3) if channel and k is not None else 0)
    s_strides = (*k_scales.stride()[:3], k_scales.stride(3) if channel and k is not None else 0)
    positions = rope.positions if rope is not None else query
    freqs = rope.freqs if rope is not None else query
    mask_rows = mask if mask is not None else query
    on_device(_plain_split_kernel)[(batch * kv_heads, splits, blocks)](
        query, k_codes, k_scales, k_mins, k_tail, v_codes, v_scales, v_mins, positions, freqs, mask_rows, o, m, l_sum,
        query, query,
        kv_heads, n_tokens, coded, sink_keys.shape[2], per_split, float(scale), 0, causal_offset,
        *strides, *k_strides, *s_strides, *k_tail.stride()[:3], *v_codes.stride()[:3],
        *v_scales.stride()[:3], positions.stride(0), positions.stride(-1), *mask_strides(mask), 0, 0,
        GROUP=group, G_PAD=g_pad, D=dim, T=tile, K_KIND=k_kind, K_BS=k_block, K_CHANNEL=channel,
        V_KIND=int(v.fmt.kind), V_BS=v.fmt.block_size, K_STAGES=log2_of(keys.rotation),
        K_SCALE=rotation_scale(keys.rotation) if keys.rotation else 1.0, ROPE=rope is not None,
        MASK=mask is not None, INDEXED=False, SCORES=False, NQ=n_queries, ONE=n_queries == 1,
        num_warps=4 if dim < 128 else 8,
    )  # fmt: skip
    return merge_splits(query, sink_keys, sink_values, (o, m, l_sum), mask, scale, values.rotation, rows)
