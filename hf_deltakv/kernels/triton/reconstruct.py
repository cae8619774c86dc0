"""Triton kernels: a stored stream decoded straight into the history a prefill's attention reads (the output's dtype,
no full-precision copy). Specification: `reference.decode_into`.

- adaptive keys: a program per (batch, kv head, group) decodes its group's bit planes (as the attention kernel
  does), re-applies RoPE from the positions (`common.turned_cos_sin`) and writes the group's tokens in the model's
  channel order; the raw tail is one more group of programs.
- plain values: a program per (batch, kv head, tile of tokens) dequantizes the tile and undoes the rotation
  (butterflies, bit for bit the reference's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Kind
from ...quant.bitplanes import MAX_BITS
from ..hadamard import rotation_scale
from ..layout import AdaptiveStream, PlainStream, RopeAngles
from .adaptive_attention import WORDS, _plane_codes, words_aligned
from .common import EXACT, butterflies, log2_of, on_device, program, saturate_fp16, to_dtype, turned_cos_sin


@triton.jit(do_not_specialize=("n_coded", "coded", "tail_tokens"))
def _adaptive_keys_kernel(
    planes_ptr, depths_ptr, low_ptr, step_ptr, tail_ptr, pos_ptr, freq_ptr, order_ptr, out_ptr,
    heads, n_coded, coded, tail_tokens, pad,
    spb, sph, spg, sdb, sdh, sdg, slb, slh, slg, ssb, ssh, ssg, stb, sth, stt, sxb, sxt, sob, soh, sot,
    D: tl.constexpr, GS: tl.constexpr, WORD: tl.constexpr, ROPE: tl.constexpr, ORDER: tl.constexpr,
    SATURATE: tl.constexpr, MOST: tl.constexpr,
):  # fmt: skip
    unit, bh = program(0), program(1)
    b, h = bh // heads, bh % heads
    half: tl.constexpr = D // 2
    c = tl.arange(0, half)
    slot = tl.arange(0, GS)
    if unit < n_coded:
        token = unit * GS + slot - pad
        valid = token >= 0
        packed = tl.load(depths_ptr + b * sdb + h * sdh + unit * sdg + c).to(tl.int32)
        d_lo, d_hi = packed & 15, packed >> 4
        p_lo = tl.cumsum(d_lo, axis=0) - d_lo
        p_hi = tl.sum(d_lo, axis=0) + tl.cumsum(d_hi, axis=0) - d_hi
        words = planes_ptr.to(tl.pointer_type(WORD)) + b * spb + h * sph + unit * spg
        at_low = low_ptr + b * slb + h * slh + unit * slg
        at_step = step_ptr + b * ssb + h * ssh + unit * ssg
        k_lo = (
            tl.load(at_low + c).to(tl.float32)[None, :]
            + _plane_codes(words, p_lo, d_lo, slot, MOST, WORD).to(tl.float32)
            * tl.load(at_step + c).to(tl.float32)[None, :]
        )
        k_hi = (
            tl.load(at_low + half + c).to(tl.float32)[None, :]
            + _plane_codes(words, p_hi, d_hi, slot, MOST, WORD).to(tl.float32)
            * tl.load(at_step + half + c).to(tl.float32)[None, :]
        )
        # fp16 values, as reference.decode_groups (what a crop puts back into the tail)
        k_lo = saturate_fp16(k_lo).to(tl.float16).to(tl.float32)
        k_hi = saturate_fp16(k_hi).to(tl.float16).to(tl.float32)
    else:  # the raw tail
        token = coded + slot.to(tl.int64)  # (int64 in both branches: `unit` is)
        valid = slot < tail_tokens
        raw = tail_ptr + b * stb + h * sth + slot[:, None] * stt
        k_lo = tl.load(raw + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        k_hi = tl.load(raw + half + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    if ROPE:  # rope.rotate_pairs with cos and sin of the positions' angles
        pos = tl.load(pos_ptr + b * sxb + token * sxt, mask=valid, other=0)
        cos, sin = turned_cos_sin(pos[:, None], tl.load(freq_ptr + c)[None, :])
        k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
    if ORDER:  # canonical channel c is the model's channel order[c]
        lo_at, hi_at = tl.load(order_ptr + c), tl.load(order_ptr + half + c)
    else:
        lo_at, hi_at = c, c + half
    rows = out_ptr + b * sob + h * soh + token[:, None] * sot
    keep = valid[:, None]
    lo = saturate_fp16(k_lo) if SATURATE else k_lo
    hi = saturate_fp16(k_hi) if SATURATE else k_hi
    tl.store(rows + lo_at[None, :], to_dtype(lo, out_ptr.dtype.element_ty), mask=keep)
    tl.store(rows + hi_at[None, :], to_dtype(hi, out_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=("length",))
def _plain_values_kernel(
    codes_ptr, scales_ptr, mins_ptr, out_ptr,
    heads, length, scb, sch, sct, ssb, ssh, sst, sob, soh, sot,
    D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, ASYM: tl.constexpr, T: tl.constexpr,
    STAGES: tl.constexpr, ROT_SCALE: tl.constexpr, SATURATE: tl.constexpr,
):  # fmt: skip
    tile, bh = program(0), program(1)
    b, h = bh // heads, bh % heads
    token = tile * T + tl.arange(0, T)
    valid = token < length
    e = tl.arange(0, D)
    block = e // BS
    s = tl.load(scales_ptr + b * ssb + h * ssh + token[:, None] * sst + block[None, :], mask=valid[:, None], other=0.0)
    s = s.to(tl.float32)
    codes = codes_ptr + b * scb + h * sch + token[:, None] * sct
    if BITS == 8:
        x = tl.load(codes + e[None, :], mask=valid[:, None], other=0).to(tl.float32) * s
    else:  # byte j of a block: code j low, code j + BS / 2 high (llama.cpp's order)
        within = e % BS
        byte = block * (BS // 2) + within % (BS // 2)
        packed = tl.load(codes + byte[None, :], mask=valid[:, None], other=0)
        code = ((packed >> ((within // (BS // 2)) * 4)[None, :]) & 0x0F).to(tl.float32)
        if ASYM:
            m = tl.load(mins_ptr + b * ssb + h * ssh + token[:, None] * sst + block[None, :], mask=valid[:, None])
            x = code * s + m.to(tl.float32)
        else:
            x = (code - 8.0) * s
    if STAGES > 0:  # the rotation undone (the butterflies are their own inverse)
        x = butterflies(x, T, D, STAGES, ROT_SCALE)
    x = saturate_fp16(x) if SATURATE else x
    tl.store(out_ptr + b * sob + h * soh + token[:, None] * sot + e[None, :], to_dtype(x, out_ptr.dtype.element_ty),
             mask=valid[:, None])  # fmt: skip


def serves(stream, out: torch.Tensor) -> bool:
    """Adaptive streams (planes on word boundaries: `words_aligned`) and plain q4_0/q4_1/q8_0-family streams of a
    power-of-two width, rows contiguous."""
    dim = stream.dim
    if dim < 16 or dim & (dim - 1) or out.stride(-1) != 1:
        return False
    if isinstance(stream, AdaptiveStream):
        stored = [stream.tail] + (
            [] if stream.planes is None else [stream.planes, stream.bits, stream.low, stream.step]
        )
        aligned = stream.group in WORDS and words_aligned(stream.planes, stream.group)
        return aligned and all(t.stride(-1) == 1 for t in stored) and stream.tail.shape[2] <= stream.group
    if isinstance(stream, PlainStream):
        fmt = stream.blocks.fmt
        ok = fmt.kind in (Kind.Q4_SYM, Kind.Q4_ASYM, Kind.Q8) and dim % fmt.block_size == 0
        return ok and all(t.stride(-1) == 1 for t in stream.blocks.tensors())
    return False


def decode_into(stream, out: torch.Tensor, rope: RopeAngles | None = None, order: torch.Tensor | None = None) -> None:
    """`reference.decode_into` (see there) for the streams of `serves`."""
    batch, heads = out.shape[:2]
    saturate = out.dtype == torch.float16
    if isinstance(stream, PlainStream):
        q = stream.blocks
        codes = q.codes.view(torch.int8) if q.fmt.bits == 8 else q.codes
        tile = 16
        on_device(_plain_values_kernel)[(triton.cdiv(stream.length, tile), batch * heads)](
            codes, q.scales, q.mins if q.mins is not None else q.scales, out,
            heads, stream.length, *codes.stride()[:3], *q.scales.stride()[:3], *out.stride()[:3],
            D=stream.dim, BS=q.fmt.block_size, BITS=q.fmt.bits, ASYM=q.mins is not None, T=tile,
            STAGES=log2_of(stream.rotation), ROT_SCALE=rotation_scale(stream.rotation) if stream.rotation else 1.0,
            SATURATE=saturate, **EXACT,
        )  # fmt: skip
        return
    n_coded = 0 if stream.planes is None else stream.planes.shape[2]
    tail = stream.tail
    units = n_coded + (tail.shape[2] > 0)
    if not units:
        return
    coded = n_coded * stream.group - stream.offset if n_coded else 0
    planes = stream.planes if n_coded else tail
    word_bytes = stream.group // 8
    plane_strides = [s // word_bytes for s in planes.stride()[:3]] if n_coded else [0, 0, 0]
    others = [t.stride()[:3] for t in ((stream.bits, stream.low, stream.step) if n_coded else (tail, tail, tail))]
    positions = rope.positions if rope is not None else tail
    on_device(_adaptive_keys_kernel)[(units, batch * heads)](
        planes, stream.bits if n_coded else tail, stream.low if n_coded else tail, stream.step if n_coded else tail,
        tail, positions, rope.freqs if rope is not None else tail, order if order is not None else tail, out,
        heads, n_coded, coded, tail.shape[2], stream.offset,
        *plane_strides, *others[0], *others[1], *others[2], *tail.stride()[:3], positions.stride(0),
        positions.stride(-1), *out.stride()[:3],
        D=stream.dim, GS=stream.group, WORD=WORDS[stream.group], ROPE=rope is not None, ORDER=order is not None,
        SATURATE=saturate, MOST=MAX_BITS, num_warps=4 if stream.dim * stream.group < 4096 else 8, **EXACT,
    )  # fmt: skip
