"""Eviction, what users pick instead of compression: keep some tokens at full precision (fp16), drop the rest.

Two policies, as baselines measured at the same memory as our caches:
- StreamingLLM (Xiao et al., arXiv 2309.17453): the first `sink_tokens` tokens (attention sinks) and the most recent
  ones, `keep` of all tokens seen in total.
- SnapKV (Li et al., arXiv 2404.14469): per kv head, the tokens the last `window` queries of each forward attended to
  most (their attention summed over the query heads of the group and max-pooled over `kernel` neighbouring
  positions), plus those `window` most recent tokens, `keep` of all tokens seen in total. SnapKV compresses a prompt
  once; here every forward (a prefill chunk, a decoding step) is such a prompt, so the budget holds at every length.

Eviction happens once a forward's attention has read the layer (`read_done`), so that forward attends to everything it
stored, as transformers' own caches do. Tokens keep the RoPE they were given (no re-rotation to new slots).
Attention runs here, in PyTorch, over the kept tokens and their positions' columns of the model's mask: the layer
serves `scaled_dot_product_attention` (transformers' default); other attention implementations are refused, since a
dense history cannot say which tokens are gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..quant import saturate_fp16
from .base import StreamLayer

POLICIES = ("streaming", "snapkv")
QUERY_CHUNK = 256  # queries attended at a time (bounds the score buffer)


class EvictingLayer(StreamLayer):
    """A layer keeping `keep` of the tokens it has seen (fp16), chosen by `policy` (`POLICIES`).

    Args:
        policy: "streaming" (sinks + recent) or "snapkv" (most attended + recent).
        keep: fraction of the tokens seen that stays, in (0, 1].
        sink_tokens: first tokens always kept (StreamingLLM's sinks; held raw by `StreamLayer`).
        window: recent tokens always kept, whose queries SnapKV observes (at least 1).
        kernel: SnapKV's pooling width over positions (odd).
    """

    attend_max_queries = math.inf  # attention is always served here (see the module docstring)

    def __init__(self, policy: str, keep: float, sink_tokens: int = 0, window: int = 32, kernel: int = 7) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.keep, self.recent, self.kernel = policy, keep, window, kernel
        super().__init__(sink_tokens)

    def _clear_stream(self) -> None:
        self.keys = self.values = None  # fp16 [B, H, n, D] of the kept stream tokens
        self.index = None  # int32 [B, H, n]: their positions
        self.importance = None  # fp32 [B, H, n]: SnapKV's observed attention (this forward only)

    def _append_stream(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        batch, heads, new, _ = keys.shape
        index = torch.arange(begin, begin + new, device=keys.device, dtype=torch.int32).expand(batch, heads, new)
        parts = [(self.keys, saturate_fp16(keys)), (self.values, saturate_fp16(values)), (self.index, index)]
        self.keys, self.values, self.index = (new if old is None else torch.cat([old, new], 2) for old, new in parts)
        if self.importance is not None:
            self.importance = torch.cat([self.importance, keys.new_zeros(batch, heads, new, dtype=torch.float32)], 2)

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values `[B, H, m, D]` (sinks first) and their positions `[B, H, m]`."""
        keys, values, index = [self.keys], [self.values], [self.index]
        if self.sink_keys is not None:
            sinks = self.sink_keys.shape[2]
            positions = torch.arange(sinks, device=self.device, dtype=torch.int32)
            keys.insert(0, self.sink_keys.to(torch.float16))
            values.insert(0, self.sink_values.to(torch.float16))
            index.insert(0, positions.expand(self.batch_size, self.kv_heads, sinks))
        return tuple(torch.cat([t for t in ts if t is not None], 2) for ts in (keys, values, index))

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention over the kept tokens: each one's column of `mask` (all positions `[B, 1 | Hq, n, seen]`; None:
        causal), in fp32. Records SnapKV's observation of the last `window` queries."""
        batch, q_heads, n, dim = query.shape
        group = q_heads // self.kv_heads
        keys, values, index = self._held()
        keys, values = keys.float(), values.float()
        q = query.float().view(batch, self.kv_heads, group, n, dim)
        outputs, observed = [], None
        for start in range(0, n, QUERY_CHUNK):
            end = min(start + QUERY_CHUNK, n)
            allowed = self._allowed(mask, index, start, end, n, group)  # [B, Hkv, g | 1, c, m]
            scores = torch.einsum("bhgcd,bhmd->bhgcm", q[:, :, :, start:end], keys) * scale
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).masked_fill(~allowed, 0.0)
            outputs.append(torch.einsum("bhgcm,bhmd->bhgcd", weights, values))
            first = max(start, n - self.recent)
            if self.policy == "snapkv" and end > first:  # the last `window` queries' attention, per kv head
                seen = weights[:, :, :, first - start :].sum((2, 3))
                observed = seen if observed is None else observed + seen
        if observed is not None:
            sinks = 0 if self.sink_keys is None else self.sink_keys.shape[2]
            stream = observed[:, :, sinks:]
            self.importance = stream if self.importance is None else self.importance + stream
        return torch.cat(outputs, dim=3).view(batch, q_heads, n, values.shape[-1])

    def _allowed(self, mask, index, start: int, end: int, n: int, group: int) -> torch.Tensor:
        positions = index[:, :, None, None, :].long()  # [B, Hkv, 1, 1, m]
        if mask is None:
            last = self.cumulative_length - n + torch.arange(start, end, device=index.device)
            return positions <= last[None, None, None, :, None]
        mask = mask[:, :, start:end]
        if mask.shape[1] != 1:
            mask = mask.reshape(mask.shape[0], self.kv_heads, group, end - start, mask.shape[-1])
        else:
            mask = mask[:, :, None]
        gather = positions.expand(mask.shape[0], self.kv_heads, mask.shape[2], end - start, positions.shape[-1])
        return mask.expand(mask.shape[0], self.kv_heads, *mask.shape[2:]).gather(-1, gather)

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            "an evicting cache serves scaled_dot_product_attention only (transformers' default 'sdpa'): a dense "
            "history cannot say which tokens were dropped; load the model with attn_implementation='sdpa'"
        )

    def read_done(self) -> None:
        """The forward has read the layer: drop what the policy does not keep."""
        super().read_done()
        if self.keys is None or self.record_past:
            self.importance = None
            return
        budget = max(math.ceil(self.keep * self.cumulative_length) - self.sink_tokens, self.recent)
        stored = self.keys.shape[2]
        if stored > budget:
            self._keep(self._chosen(budget))
        self.importance = None

    def _chosen(self, budget: int) -> torch.Tensor:
        """Indices `[B, H, budget]` (in stored order) of the stream tokens to keep."""
        batch, heads, stored = self.index.shape
        recent = min(self.recent, budget)
        positions = torch.arange(stored, device=self.index.device).expand(batch, heads, stored)
        if self.policy == "streaming" or self.importance is None:
            return positions[:, :, stored - budget :]
        score = torch.nn.functional.max_pool1d(
            self.importance.reshape(batch * heads, 1, stored), self.kernel, stride=1, padding=self.kernel // 2
        ).view(batch, heads, stored)
        score[:, :, stored - recent :] = float("inf")  # the recent window always stays
        return score.topk(budget, dim=-1).indices.sort(dim=-1).values

    def _keep(self, chosen: torch.Tensor) -> None:
        take = chosen[..., None]
        self.keys = self.keys.gather(2, take.expand(*chosen.shape, self.keys.shape[-1]))
        self.values = self.values.gather(2, take.expand(*chosen.shape, self.values.shape[-1]))
        self.index = self.index.gather(2, chosen)

    def _decode_stream(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise AssertionError("not reached: reconstruct() refuses")

    def _stream_held(self) -> list:
        return [self.keys, self.values, self.index, self.importance]

    def _map_stream(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("keys", "values", "index", "importance"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def _truncate_stream(self, tokens: int) -> None:
        """Keep the stream tokens before position `sink_tokens + tokens` (a crop)."""
        if self.index is None:
            return
        # A crop cuts the newest tokens, stored last in every head (eviction pauses while transformers records the
        # past for one): the same count in every head.
        drop = int((self.index[0, 0] >= self.sink_tokens + tokens).sum())
        for name in ("keys", "values", "index"):
            setattr(self, name, getattr(self, name)[:, :, : self.index.shape[2] - drop].contiguous())
        self.importance = None
