"""The residual cache codes a token's heads together: moving between the cache's and the coder's shapes."""

from __future__ import annotations

import torch


def heads_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, n, dim]` -> `[batch, n, heads * dim]`."""
    batch, heads, n, dim = x.shape
    return x.permute(0, 2, 1, 3).reshape(batch, n, heads * dim)


def tokens_to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[batch, n, heads * dim]` -> `[batch, heads, n, dim]`."""
    batch, n, width = x.shape
    return x.reshape(batch, n, heads, width // heads).permute(0, 2, 1, 3)
