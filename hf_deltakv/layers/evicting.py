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

Storage (`kernels.KeptStream`): fp16 keys and values in slots, in the order of their positions, with each slot's
position in an index. Evicting a token marks its slot (-1; StreamingLLM's oldest slots are skipped by a counter on the
host), so that a decoding step moves nothing: it writes the new token into the room after the last slot, attends over
the slots (a slot's mask column is its position) and, with SnapKV, chooses the slot to evict, on the device (on GPUs
three or four Triton launches, no sync). When the room runs out, or the evicted slots exceed what a decoding step's
room is worth, the kept tokens are compacted into new storage (a copy of what is kept, amortized as a growth is).
SnapKV's choice of a decoding step is marked at the next update (a forward undone after that marks it again: the
same slot), so a forward stopped midway leaves the layer as it was. Attention runs over the kept tokens and their
positions' columns of the model's mask: the layer serves `scaled_dot_product_attention` (transformers' default);
other attention implementations are refused, since a dense history cannot say which tokens are gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import kernels
from ..codecs.base import ROOM_FRACTION, ROOM_MIN
from ..kernels.layout import KeptStream, Observation
from .base import StreamLayer

POLICIES = ("streaming", "snapkv")


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
        self.keys = self.values = None  # fp16 [B, H, slots, D]: views over the first slots of buffers with room
        self.index = None  # int32 [B, H, slots]: each slot's position, -1 once evicted
        self.first = 0  # slots before this one are evicted in every head (StreamingLLM's oldest)
        self.live = 0  # tokens kept in each head's slots
        self.pending = None  # int64 [B, H, k]: slots SnapKV evicted at the end of the last forward, marked at the next
        self.observed = None  # what SnapKV observed of this forward's attention (until `read_done`)
        self._growing_slots = None  # (keys, values, index) buffers behind the views

    def _stream(self, buffers: bool = False) -> KeptStream:
        """The kept tokens as the ops read them (`buffers`: over the whole buffers, for writing past the slots)."""
        keys, values, index = self._growing_slots if buffers else (self.keys, self.values, self.index)
        return KeptStream(keys, values, index, self.first, self.live)

    def _append_stream(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        n = keys.shape[2]
        at = self._room(n)
        pending, self.pending = self.pending, None
        kernels.keep_rows(keys, values, self._stream(buffers=True), at, begin, pending)
        self.keys, self.values, self.index = (t[:, :, : at + n] for t in self._growing_slots)
        self.live += n

    def _room(self, n: int) -> int:
        """The first slot of `n` new tokens: after the last one, in the buffers when they have room (and the views are
        still theirs), else in new ones holding the kept tokens compacted, with room for decoding."""
        slots = 0 if self.keys is None else self.keys.shape[2]
        held = self._growing_slots
        if held is not None and self.keys is not None and held[0].data_ptr() == self.keys.data_ptr():
            if held[0].shape[2] >= slots + n:
                return slots
        room = 0 if self.keys is None else max(ROOM_MIN, (self.live + n) // ROOM_FRACTION)  # (a prefill: none)
        return self._compact(n + room)

    def _compact(self, room: int) -> int:
        """New buffers holding the kept tokens in their first slots, in order (`kernels.compact_kept`: one launch on
        GPUs), and `room` more; returns the next slot. The stored buffers are not changed (a forward undone keeps
        them)."""
        shape = (self.batch_size, self.kv_heads, self.live + room)
        f16 = {"dtype": torch.float16, "device": self.device}
        grown = KeptStream(torch.empty(*shape, self.head_dim, **f16), torch.empty(*shape, self.value_dim, **f16),
                           torch.empty(*shape, dtype=torch.int32, device=self.device), 0, self.live)  # fmt: skip
        if self.live:
            kernels.compact_kept(self._stream(), self.pending, grown)
        self._growing_slots = (grown.keys, grown.values, grown.index)
        self.keys, self.values, self.index = (t[:, :, : self.live] for t in self._growing_slots)
        self.first, self.pending = 0, None
        return self.live

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention over the kept tokens (`kernels.kept_attention`): each one's column of `mask` (all positions
        `[B, 1 | Hq, n, seen]`; None: causal), in fp32. Records SnapKV's observation of the last `window` queries."""
        n = query.shape[2]
        if self.keys is None:  # every token so far is a sink
            return super().attend(query, mask, scale)
        if self.pending is not None:  # (an update that stored nothing: mark them now)
            self.index.scatter_(2, self.pending, -1)
            self.pending = None
        if self.sink_keys is not None:
            sink_keys, sink_values = self.sink_keys, self.sink_values
        else:
            sink_keys = query.new_empty(self.batch_size, self.kv_heads, 0, self.head_dim)
            sink_values = query.new_empty(self.batch_size, self.kv_heads, 0, self.value_dim)
        observe_from = max(n - self.recent, 0) if self.policy == "snapkv" else None
        out, self.observed = kernels.kept_attention(query, sink_keys, sink_values, self._stream(), mask, scale,
                                                    self.cumulative_length - n, observe_from)  # fmt: skip
        return out

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            "an evicting cache serves scaled_dot_product_attention only (transformers' default 'sdpa'): a dense "
            "history cannot say which tokens were dropped; load the model with attn_implementation='sdpa'"
        )

    def read_done(self) -> None:
        """The forward has read the layer: drop what the policy does not keep."""
        super().read_done()
        observed, self.observed = self.observed, None
        if self.keys is None or self.record_past:
            return
        budget = max(math.ceil(self.keep * self.cumulative_length) - self.sink_tokens, self.recent)
        drop = self.live - budget
        if drop <= 0:
            return
        if self.policy == "streaming":  # the oldest: the first slots (none after `first` is ever evicted)
            self.first += drop
        else:
            if observed is None:  # (no attention observed: the oldest)
                observed = torch.zeros(self.index.shape, dtype=torch.float32, device=self.device)
            recent = min(self.recent, budget)
            self.pending = kernels.snapkv_evicted(self._stream(), observed, drop, recent, self.kernel)
        self.live -= drop
        if self.keys.shape[2] - self.live > max(ROOM_MIN, self.live // ROOM_FRACTION):  # evicted slots worth a copy
            self._compact(max(ROOM_MIN, self.live // ROOM_FRACTION))

    def kept_positions(self) -> torch.Tensor:
        """Positions of the stream tokens kept, int32 `[batch, heads, kept]` in order (reads the device)."""
        index = self.index[:, :, self.first :]
        if self.pending is not None:
            index = index.scatter(2, self.pending - self.first, -1)
        return index.sort(dim=-1).values[..., index.shape[2] - self.live :]

    def _decode_stream(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.keys is None:  # (attention over the sinks alone)
            return None
        raise AssertionError("not reached: reconstruct() refuses, attend() reads the slots")

    def _stream_held(self) -> list:
        observed = self.observed
        if isinstance(observed, Observation):
            observed = [observed.scores, observed.maximum, observed.total]
        return [self.keys, self.values, self.index, self.pending, observed]

    def _map_stream(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is None:
            return
        self.keys, self.values, self.index = fn(self.keys), fn(self.values), fn(self.index)
        self.pending = None if self.pending is None else fn(self.pending)
        self.observed, self._growing_slots = None, None

    def _truncate_stream(self, tokens: int) -> None:
        """Keep the stream tokens before position `sink_tokens + tokens` (a crop)."""
        if self.keys is None:
            return
        self._compact(0)
        # A crop cuts the newest tokens, stored last in every head (eviction pauses while transformers records the
        # past for one): the same count in every head.
        drop = int((self.index[0, 0] >= self.sink_tokens + tokens).sum())
        self.live -= drop
        self.keys, self.values, self.index = (t[:, :, : self.live].clone() for t in self._growing_slots)
        self._growing_slots = None
