"""Triton kernel: matrix-vector product that reads only the kept input blocks of the weight (see `weight_skip`).

Specification: `reference.skip_matvec`. One program computes `BLOCK_N` outputs of one sequence and loops over the
indices of the kept blocks only, so skipped weights are never loaded. Plain `tl` operations only (no
vendor intrinsics), so the same kernel serves NVIDIA and AMD GPUs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skip_matvec_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    kept_ptr,
    out_ptr,
    n_out,
    n_in,
    n_kept,
    stride_xb,
    stride_wn,
    stride_wk,
    stride_ob,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, n_kept):
        block = tl.load(kept_ptr + i)
        cols = block * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + pid_b * stride_xb + cols, mask=cols < n_in, other=0.0).to(tl.float32)
        w_mask = (rows[:, None] < n_out) & (cols[None, :] < n_in)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=w_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows < n_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_b * stride_ob + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < n_out)


def skip_matvec(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor,
    block_size: int,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton version of `reference.skip_matvec`; `block_size` must be a power of two (Triton's tile sizes)."""
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block_size, got {block_size}")
    x = x.contiguous()
    batch, n_in = x.shape
    n_out = weight.shape[0]
    kept = keep.nonzero().flatten().to(torch.int32)
    out = torch.empty(batch, n_out, dtype=weight.dtype, device=x.device)
    grid = (triton.cdiv(n_out, block_n), batch)
    _skip_matvec_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,
        kept,
        out,
        n_out,
        n_in,
        kept.numel(),
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_size,
    )
    return out
