"""Triton kernel: decode attention straight from a block-quantized cache (flash-decoding / split-K, GQA-aware).
Specification: `reference.stream_attention` over plain streams (the stream part; sinks are merged by the caller).

Grid: (batch × kv_heads, splits). A program loads the queries of every query head sharing its kv head, walks its
share of the tokens in tiles, dequantizes the tile's packed keys and values in registers (never writing a
full-precision copy), and keeps an online softmax. Partial results (max, sum, weighted values) of the splits are
combined afterwards. Reading 4.5-bit codes instead of 16-bit values is where the speed on a GPU comes from.
Plain `tl` operations only, so the same kernel serves NVIDIA and AMD GPUs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Kind, QuantizedTensor
from ..hadamard import rotate
from ..layout import PlainStream

TILE_KINDS = (Kind.Q4_SYM, Kind.Q4_ASYM, Kind.Q8)  # the block arithmetic `_load_tile` decodes


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
    """Dequantized [BLOCK_T, D] tile of one head's tokens `tok` (rows past `valid` read as zeros)."""
    e = tl.arange(0, D)
    blk = e // BLOCK
    within = e % BLOCK
    n_blocks: tl.constexpr = D // BLOCK
    # (a constexpr is assigned once: GPU compilers refuse a second assignment that the interpreter lets through)
    bytes_per_token: tl.constexpr = D if BITS == 8 else D // 2
    s = tl.load(scales_ptr + tok[:, None] * n_blocks + blk[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    if BITS == 8:
        q = tl.load(codes_ptr + tok[:, None] * bytes_per_token + e[None, :], mask=valid[:, None], other=0)
        return q.to(tl.float32) * s
    half: tl.constexpr = BLOCK // 2
    byte = blk * half + within % half
    packed = tl.load(codes_ptr + tok[:, None] * bytes_per_token + byte[None, :], mask=valid[:, None], other=0)
    code = ((packed >> ((within // half) * 4)[None, :]) & 0x0F).to(tl.float32)
    if ASYM:
        m = tl.load(mins_ptr + tok[:, None] * n_blocks + blk[None, :], mask=valid[:, None], other=0.0)
        return code * s + m.to(tl.float32)
    return (code - 8.0) * s


@triton.jit
def load_queries(q_ptr, bh, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    """The `[G_PAD, D]` fp32 queries of the query heads sharing kv head `bh` (rows past GROUP are zeros)."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = bh * GROUP + g  # rows of q viewed as [batch * kv_heads * GROUP, D]
    return tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_partials(o_ptr, m_ptr, l_ptr, bh, split, n_splits, acc, m_i, l_i, G_PAD: tl.constexpr, D: tl.constexpr):
    """One split's running statistics, combined afterwards by `combine_splits`."""
    out = (bh * n_splits + split) * G_PAD + tl.arange(0, G_PAD)
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


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    kc_ptr,
    ks_ptr,
    km_ptr,
    vc_ptr,
    vs_ptr,
    vm_ptr,
    mask_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    kv_heads,
    n_tokens,
    tokens_per_split,
    scale,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    K_ASYM: tl.constexpr,
    V_ASYM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // kv_heads
    q = load_queries(q_ptr, bh, GROUP, G_PAD, D)
    n_blocks: tl.constexpr = D // BLOCK
    code_bytes: tl.constexpr = D if BITS == 8 else D // 2
    head_tokens = bh * n_tokens
    k_codes, v_codes = kc_ptr + head_tokens * code_bytes, vc_ptr + head_tokens * code_bytes
    k_scales, v_scales = ks_ptr + head_tokens * n_blocks, vs_ptr + head_tokens * n_blocks
    k_mins, v_mins = km_ptr + head_tokens * n_blocks, vm_ptr + head_tokens * n_blocks
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, n_tokens)
    for t0 in range(start, end, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        valid = tok < end
        if HAS_MASK:
            valid = valid & (tl.load(mask_ptr + b * n_tokens + tok, mask=valid, other=0) != 0)
        k = _load_tile(k_codes, k_scales, k_mins, tok, valid, D, BLOCK, BITS, K_ASYM)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, BLOCK_T]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        v = _load_tile(v_codes, v_scales, v_mins, tok, valid, D, BLOCK, BITS, V_ASYM)
        m_i, l_i, acc = fold_tile(scores, v, m_i, l_i, acc)
    store_partials(o_ptr, m_ptr, l_ptr, bh, split, n_splits, acc, m_i, l_i, G_PAD, D)


def _flat(q: QuantizedTensor, name: str) -> torch.Tensor:
    t = getattr(q, name)
    return t.contiguous() if t is not None else q.scales.contiguous()


def _codes(q: QuantizedTensor) -> torch.Tensor:
    """Packed codes as the kernel reads them: q8_0's bytes are signed."""
    return q.codes.contiguous().view(torch.int8) if q.fmt.bits == 8 else q.codes.contiguous()


def supports(keys: PlainStream, values: PlainStream, rope: bool) -> bool:
    """Plain streams of one block format (not f16) tiling a power-of-two head dim, keys after RoPE (the kernel
    applies none; rotated keys are served by rotating the query instead)."""
    fmt, dim = keys.blocks.fmt, keys.dim
    if fmt.name != values.blocks.fmt.name or fmt.kind not in TILE_KINDS or dim != values.dim:
        return False
    return dim % fmt.block_size == 0 and not dim & (dim - 1) and not rope


def plain_attention(
    query: torch.Tensor,
    keys: PlainStream,
    values: PlainStream,
    mask: torch.Tensor | None,
    sinks: int,
    scale: float,
    block_t: int = 16,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax statistics `(acc, max, sum)` of one query per head over plain block-quantized keys and values
    (spec: `reference.stream_attention` without sinks); `acc` in the values' original basis.

    Args:
        query: fp32 `[batch, kv_heads, group, dim]`.
        keys, values: plain streams of one block format (see `supports`).
        mask: bool `[batch, sinks + tokens]` or None.
    """
    batch, kv_heads, group, dim = query.shape
    n_tokens = keys.length
    if keys.rotation:  # q . (H^T k) == (q H) . k: rotate the query once instead of every key
        query = rotate(query)
    g_pad = max(triton.next_power_of_2(group), 1)
    splits = splits or max(1, min(32, triton.cdiv(n_tokens, 256)))
    per_split = triton.cdiv(triton.cdiv(n_tokens, splits), block_t) * block_t
    splits = triton.cdiv(n_tokens, per_split)
    device = query.device
    o = torch.empty(batch * kv_heads, splits, g_pad, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * kv_heads, splits, g_pad, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    mask_u8 = mask[:, sinks:].to(torch.uint8).contiguous() if mask is not None else o
    k, v = keys.blocks, values.blocks
    _decode_attention_kernel[(batch * kv_heads, splits)](
        query.float().contiguous(),
        _codes(k),
        k.scales.contiguous(),
        _flat(k, "mins"),
        _codes(v),
        v.scales.contiguous(),
        _flat(v, "mins"),
        mask_u8,
        o,
        m,
        l_sum,
        kv_heads,
        n_tokens,
        per_split,
        float(scale),
        GROUP=group,
        G_PAD=g_pad,
        D=dim,
        BLOCK=k.fmt.block_size,
        BITS=k.fmt.bits,
        K_ASYM=k.mins is not None,
        V_ASYM=v.mins is not None,
        HAS_MASK=mask is not None,
        BLOCK_T=block_t,
    )
    acc, top, total = (t[:, :group] for t in combine_splits(o, m, l_sum))
    acc = rotate(acc, inverse=True) if values.rotation else acc
    shape = (batch, kv_heads, group)
    return acc.reshape(*shape, dim), top.reshape(shape), total.reshape(shape)
