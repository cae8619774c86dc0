"""Triton kernel: weight skip's decode linear, reading only the kept rows of the input-major weight.

Specification: `reference.sparse_matvec`. The kept channels are listed once (`reference.kept_channels`, a few
element-wise ops on the activations); one program then computes `BLOCK_N` outputs of one sequence, looping over the
kept channel indices `BLOCK_K` at a time, so the rows of skipped channels are never loaded. Plain `tl` operations
only (no vendor intrinsics), so the same kernel serves NVIDIA and AMD GPUs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import kept_channels


@triton.jit
def _sparse_matvec_kernel(
    x_ptr,
    wt_ptr,
    b_ptr,
    kept_ptr,
    out_ptr,
    n_out,
    n_kept,
    stride_xb,
    stride_wk,
    stride_ob,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
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
) -> tuple[torch.Tensor, int]:
    """Triton version of `reference.sparse_matvec`."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).contiguous()
    if wt.stride(1) != 1:
        wt = wt.contiguous()
    batch = x.shape[0]
    n_out = wt.shape[1]
    kept = kept_channels(x, scale, threshold).nonzero().flatten().to(torch.int32)
    out = torch.empty(batch, n_out, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_out, block_n), batch)
    _sparse_matvec_kernel[grid](
        x,
        wt,
        bias if bias is not None else out,
        kept,
        out,
        n_out,
        kept.numel(),
        x.stride(0),
        wt.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.to(x.dtype).view(*lead, n_out), kept.numel()
