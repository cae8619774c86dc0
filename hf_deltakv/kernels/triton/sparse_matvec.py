"""Triton kernel: weight skip's decode linear, reading only the kept rows of the input-major weight.

Specification: `reference.sparse_matvec`. The kept channels are listed once (`reference.kept_channels`, a few
element-wise ops on the activations, then a stable sort that puts them first: no `nonzero`, whose size the host would
wait for); one program then computes `BLOCK_N` outputs of one sequence, looping over the kept channel indices `BLOCK_K`
at a time up to their count (read from device memory), so the rows of skipped channels are never loaded and a decoding
step never synchronizes with the host. Plain `tl` operations
only (no vendor intrinsics), so the same kernel serves NVIDIA and AMD GPUs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import kept_channels
from .common import on_device, program


@triton.jit
def _sparse_matvec_kernel(
    x_ptr,
    wt_ptr,
    b_ptr,
    kept_ptr,
    out_ptr,
    count_ptr,
    n_out,
    stride_xb,
    stride_wk,
    stride_ob,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = program(0)
    pid_b = program(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    n_kept = tl.load(count_ptr).to(tl.int32)
    for start in range(0, n_kept, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        rows = tl.load(kept_ptr + slots, mask=slots < n_kept, other=0)
        x = tl.load(x_ptr + pid_b * stride_xb + rows, mask=slots < n_kept, other=0.0).to(tl.float32)
        w_mask = (slots[:, None] < n_kept) & (cols[None, :] < n_out)
        w = tl.load(wt_ptr + rows[:, None] * stride_wk + cols[None, :], mask=w_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_b * stride_ob + cols, acc, mask=cols < n_out)


def sparse_matvec(
    x: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    threshold: float,
    block_n: int = 64,
    block_k: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.sparse_matvec`; the number of kept channels comes back as a 0-dim device tensor
    (reading it is the caller's choice: it is a sync)."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).contiguous()
    if wt.stride(1) != 1:
        wt = wt.contiguous()
    batch = x.shape[0]
    n_out = wt.shape[1]
    keep = kept_channels(x, scale, threshold)
    count = keep.sum()
    kept = torch.argsort(keep.logical_not().to(torch.uint8), stable=True).to(torch.int32)  # kept ones first, in order
    out = torch.empty(batch, n_out, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_out, block_n), batch)
    on_device(_sparse_matvec_kernel)[grid](
        x,
        wt,
        bias if bias is not None else out,
        kept,
        out,
        count,
        n_out,
        x.stride(0),
        wt.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.to(x.dtype).view(*lead, n_out), count
