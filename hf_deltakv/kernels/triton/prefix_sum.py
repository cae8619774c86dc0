"""Triton kernel: segmented prefix sum along tokens, the core of delta decoding (keyframe + running sum of
deltas, restarting at keyframes and intra-coded blocks). Specification: `reference.segmented_prefix_sum`.

One program scans one stream (a keyframe group of one head, say) over its tokens for `BLOCK_D` channels; streams
and channel tiles run in parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segmented_scan_kernel(v_ptr, r_ptr, out_ptr, n_tokens, n_channels, BLOCK_D: tl.constexpr):
    stream = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < n_channels
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for t in range(0, n_tokens):
        offset = (stream * n_tokens + t) * n_channels + cols
        v = tl.load(v_ptr + offset, mask=mask, other=0.0)
        reset = tl.load(r_ptr + offset, mask=mask, other=0)
        acc = tl.where((reset != 0) | (t == 0), v, acc + v)
        tl.store(out_ptr + offset, acc, mask=mask)


def segmented_prefix_sum(values: torch.Tensor, resets: torch.Tensor, dim: int) -> torch.Tensor:
    """Triton version of `reference.segmented_prefix_sum` (fp32 values; resets broadcastable to them)."""
    if values.dtype != torch.float32:
        raise ValueError(f"segmented_prefix_sum works in fp32, got {values.dtype}")
    dim = dim % values.dim()
    moved = values.movedim(dim, -2)
    flags = resets.expand_as(values).movedim(dim, -2)
    n_tokens, n_channels = moved.shape[-2], moved.shape[-1]
    v = moved.reshape(-1, n_tokens, n_channels).contiguous()
    r = flags.reshape(-1, n_tokens, n_channels).to(torch.uint8).contiguous()
    out = torch.empty_like(v)
    block_d = min(128, triton.next_power_of_2(max(n_channels, 1)))
    grid = (v.shape[0], triton.cdiv(n_channels, block_d))
    _segmented_scan_kernel[grid](v, r, out, n_tokens, n_channels, BLOCK_D=block_d)
    return out.reshape(moved.shape).movedim(-2, dim)
