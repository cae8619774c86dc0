"""Triton kernel: several row copies in one launch (a decoding step's storage growth: the stored rows of each grown
buffer copied into its new, larger buffer). Specification: `reference.copy_rows`.

Every copy is `[rows, span]` bytes (a head's stored rows are contiguous past the sequence dimension, so each
`(batch, head)` is one span), read and written with their own row strides; program `(chunk, row, pair)` copies
`BLOCK` bytes of one row of one pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import on_device, program

MAX_PAIRS = 8  # copies per launch
BLOCK = 1024


@triton.jit
def _copy_one(src, dst, span, ss, ds, rows, row, start, BLOCK: tl.constexpr):
    at = start + tl.arange(0, BLOCK)
    keep = at < tl.where(row < rows, span, 0)
    tl.store(dst + row * ds + at, tl.load(src + row * ss + at, mask=keep), mask=keep)


@triton.jit(do_not_specialize=tuple(f"{kind}{i}" for kind in "nabr" for i in range(8)))
def _copy_rows_kernel(
    s0, s1, s2, s3, s4, s5, s6, s7, d0, d1, d2, d3, d4, d5, d6, d7,
    n0, n1, n2, n3, n4, n5, n6, n7, a0, a1, a2, a3, a4, a5, a6, a7,
    b0, b1, b2, b3, b4, b5, b6, b7, r0, r1, r2, r3, r4, r5, r6, r7,
    BLOCK: tl.constexpr,
):  # fmt: skip
    start, row, pair = program(0) * BLOCK, program(1), program(2)
    # (Triton has no arrays of pointers to index by `pair`: eight pairs of arguments, one branch each)
    if pair == 0:
        _copy_one(s0, d0, n0, a0, b0, r0, row, start, BLOCK)
    elif pair == 1:
        _copy_one(s1, d1, n1, a1, b1, r1, row, start, BLOCK)
    elif pair == 2:
        _copy_one(s2, d2, n2, a2, b2, r2, row, start, BLOCK)
    elif pair == 3:
        _copy_one(s3, d3, n3, a3, b3, r3, row, start, BLOCK)
    elif pair == 4:
        _copy_one(s4, d4, n4, a4, b4, r4, row, start, BLOCK)
    elif pair == 5:
        _copy_one(s5, d5, n5, a5, b5, r5, row, start, BLOCK)
    elif pair == 6:
        _copy_one(s6, d6, n6, a6, b6, r6, row, start, BLOCK)
    elif pair == 7:
        _copy_one(s7, d7, n7, a7, b7, r7, row, start, BLOCK)


def _row_stride(t: torch.Tensor) -> int | None:
    """The stride between consecutive `(batch, head)` of `t` `[B, H, n, ...]` when one serves both, else None."""
    batch, heads = t.shape[:2]
    if heads == 1:
        return t.stride(0)
    if batch == 1 or t.stride(0) == heads * t.stride(1):
        return t.stride(1)
    return None


def _dense_rows(t: torch.Tensor) -> bool:
    """A head's rows of `t` `[B, H, n, ...]` lie in one contiguous span."""
    dense = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:]), strict=True):
        if size > 1 and stride != dense:
            return False
        dense *= size
    return True


def _spans(src: torch.Tensor, dst: torch.Tensor) -> tuple | None:
    """(source bytes, destination bytes, span, source row stride, destination row stride, rows), strides and span
    in bytes, of copying `src` `[B, H, n, ...]` into the first `n` rows of `dst`; None when the layout does not allow
    it (the caller copies those)."""
    if src.dim() < 3 or src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
        return None
    strides = _row_stride(src), _row_stride(dst)
    if None in strides or not (_dense_rows(src) and _dense_rows(dst)):
        return None
    size = src.element_size()
    return (src.view(torch.uint8), dst.view(torch.uint8), src[0, 0].numel() * size, strides[0] * size,
            strides[1] * size, src.shape[0] * src.shape[1])  # fmt: skip


def copy_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy each `src` into the first rows of its `dst` (`reference.copy_rows`), `MAX_PAIRS` per launch; returns the
    pairs no launch could take (copied by the caller)."""
    left, spans = [], []
    for src, dst in pairs:
        span = _spans(src, dst) if src.numel() else None
        if span is None:
            if src.numel():
                left.append((src, dst))
            continue
        spans.append(span)
    for first in range(0, len(spans), MAX_PAIRS):
        chunk = spans[first : first + MAX_PAIRS]
        padded = chunk + [chunk[0]] * (MAX_PAIRS - len(chunk))  # unused slots repeat the first (never run)
        sources, targets, sizes, src_strides, dst_strides, rows = zip(*padded, strict=True)
        grid = (triton.cdiv(max(sizes), BLOCK), max(rows), len(chunk))  # the long axis first (no 65,535 limit)
        on_device(_copy_rows_kernel)[grid](*sources, *targets, *sizes, *src_strides, *dst_strides, *rows, BLOCK=BLOCK)
    return left
