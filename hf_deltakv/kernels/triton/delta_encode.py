"""Triton kernel: closed-loop delta encoding of whole keyframe groups (the prefill of `DeltaCodec`).
Specification: `reference.delta_encode_groups`.

One program codes one keyframe group of one stream: starting from the keyframe's reconstruction, each later token
of the group is coded as a 4-bit (q4_0 arithmetic, blocks of `2 * HALF` channels) delta from the previous token's
*reconstruction*; with `INTRA`, each block is instead coded against the long-term reference when that reconstructs
it better, the choice carried in the lowest mantissa bit of the block's fp16 scale. The loop over tokens is
sequential (closed loop); streams and groups run in parallel. A block is held as its two halves, because byte j of
a block packs code j (low nibble) with code j + HALF (high nibble), llama.cpp's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize import q4_0_halves


@triton.jit
def _code_against(x_lo, x_hi, base_lo, base_hi, cols, HALF: tl.constexpr):
    """q4_0 of `x - base` (blocks as halves): clipped codes, fp16 scale and the reconstruction from that scale."""
    q_lo, q_hi, d = q4_0_halves(x_lo - base_lo, x_hi - base_hi, cols, HALF)
    q_lo = tl.minimum(tl.maximum(tl.where(q_lo == q_lo, q_lo, 0.0), 0.0), 15.0)
    q_hi = tl.minimum(tl.maximum(tl.where(q_hi == q_hi, q_hi, 0.0), 0.0), 15.0)
    scale = d.to(tl.float16)
    step = scale.to(tl.float32)[:, None]
    return q_lo, q_hi, scale, base_lo + (q_lo - 8.0) * step, base_hi + (q_hi - 8.0) * step


@triton.jit
def _sse(r_lo, r_hi, x_lo, x_hi):
    return tl.sum((r_lo - x_lo) * (r_lo - x_lo), axis=1) + tl.sum((r_hi - x_hi) * (r_hi - x_hi), axis=1)


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
    group = tl.program_id(0)  # stream * groups + group: the row layout of x `[S, G, kf, D]`
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
        q_lo, q_hi, scale, new_lo, new_hi = _code_against(x_lo, x_hi, rec_lo, rec_hi, cols, HALF)
        if INTRA:
            l_lo = tl.load(long_ptr + token + lo_at)
            l_hi = tl.load(long_ptr + token + hi_at)
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
        _delta_encode_kernel[(streams * groups,)](
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
        )
    return codes, scales, recon
