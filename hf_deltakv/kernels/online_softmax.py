"""Attention over keys and values that arrive in chunks, with an online softmax: the reference of every kernel that
attends straight from packed storage.

The history is never materialised in full precision: each chunk of keys and values is reconstructed, scored and
folded into running (max, sum, weighted values) statistics, then dropped, so the transient memory is one chunk
whatever the context length (flash-decoding's split-K combine, in plain PyTorch).
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 512  # stored tokens reconstructed at a time (the bound on transient memory; a multiple of common kf)


class OnlineSoftmax:
    """Running softmax-weighted sum of values over key chunks, for queries grouped by kv head (GQA).

    Args:
        query: `[batch, q_heads, n, dim]`; q_heads must be a multiple of the chunks' kv heads.
        scale: softmax scale.
        mask: bool `[batch, 1 or q_heads, n, kv_length]`, True where a query may attend a key; None means causal
            with the `n` queries at the last `n` positions of `kv_length`.
        kv_length: total number of keys the chunks will cover.
    """

    def __init__(self, query: torch.Tensor, scale: float, mask: torch.Tensor | None, kv_length: int) -> None:
        self.batch, self.q_heads, self.n, self.dim = query.shape
        self.query, self.scale, self.mask, self.kv_length = query.float(), scale, mask, kv_length
        self.max = self.sum = self.acc = None
        self.seen = 0

    def grouped(self, kv_heads: int) -> torch.Tensor:
        """The queries `[batch, kv_heads, group, n, dim]` (fp32), grouped by the kv head they read."""
        if self.q_heads % kv_heads:
            raise ValueError(f"{self.q_heads} query heads do not share {kv_heads} kv heads evenly")
        return self.query.view(self.batch, kv_heads, self.q_heads // kv_heads, self.n, self.dim)

    def allowed(self, start: int, end: int, kv_heads: int, device: torch.device) -> torch.Tensor | None:
        """bool `[batch, 1 | kv_heads, 1 | group, n, end - start]`: which queries may attend keys `start:end`; None
        when every key is visible."""
        if self.mask is not None:
            m = self.mask[..., start:end]
            if m.shape[1] == 1:
                return m.view(m.shape[0], 1, 1, *m.shape[2:])
            return m.reshape(self.batch, kv_heads, -1, self.n, end - start)
        if self.n == 1:
            return None
        query_pos = self.kv_length - self.n + torch.arange(self.n, device=device)
        return (torch.arange(start, end, device=device)[None, :] <= query_pos[:, None])[None, None, None]

    def add(self, keys: torch.Tensor, values: torch.Tensor, start: int | None = None) -> None:
        """Fold in keys/values `[batch, kv_heads, c, dim]` at key positions `start, start + 1, ...` (default: next)."""
        start = self.seen if start is None else start
        end = start + keys.shape[2]
        q = self.grouped(keys.shape[1])
        batch, heads, group, n, dim = q.shape
        rows = q.reshape(batch, heads, group * n, dim)  # one matrix product per kv head (einsum's parsing costs more)
        scores = (rows @ keys.float().transpose(-1, -2)).view(batch, heads, group, n, -1) * self.scale
        allowed = self.allowed(start, end, keys.shape[1], keys.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        self._fold(scores.amax(-1), scores, values)
        self.seen = max(self.seen, end)

    def _fold(self, chunk_max: torch.Tensor, scores: torch.Tensor, values: torch.Tensor) -> None:
        new_max = chunk_max if self.max is None else torch.maximum(self.max, chunk_max)
        safe = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
        p = torch.exp(scores - safe[..., None])
        batch, heads, group, n, length = p.shape
        chunk_acc = (p.reshape(batch, heads, group * n, length) @ values.float()).view(batch, heads, group, n, -1)
        if self.max is None:
            self.sum, self.acc = p.sum(-1), chunk_acc
        else:
            alpha = torch.exp(self.max - safe)
            self.sum = self.sum * alpha + p.sum(-1)
            self.acc = self.acc * alpha[..., None] + chunk_acc
        self.max = new_max

    def merge(self, acc: torch.Tensor, maximum: torch.Tensor, total: torch.Tensor) -> None:
        """Fold in partial statistics computed elsewhere (a kernel): acc `[batch, kv_heads, group, n, dim]`,
        max and sum `[batch, kv_heads, group, n]`, with acc and sum relative to that max."""
        if self.max is None:
            self.max, self.sum, self.acc = maximum, total, acc
            return
        new_max = torch.maximum(self.max, maximum)
        safe = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
        mine, theirs = torch.exp(self.max - safe), torch.exp(maximum - safe)
        self.sum = self.sum * mine + total * theirs
        self.acc = self.acc * mine[..., None] + acc * theirs[..., None]
        self.max = new_max

    def result(self) -> torch.Tensor:
        """`[batch, q_heads, n, dim]` fp32; a query that saw no key gets zeros (as SDPA's masked rows do not)."""
        if self.acc is None:
            return self.query.new_zeros(self.query.shape)
        out = self.acc / self.sum.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
        return out.reshape(self.batch, self.q_heads, self.n, out.shape[-1])
