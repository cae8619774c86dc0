"""One model layer's compressed KV cache: a codec per stream (keys, values) after the sink tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .. import kernels
from ..codecs.base import ROOM_AHEAD_GROUPS, StreamCodec
from ..kernels.online_softmax import CHUNK_TOKENS
from ..rope import RopeForm
from .base import PositionLog, StreamLayer


class CompressedLayer(StreamLayer):
    """A cache layer whose keys and values live in packed codec storage.

    Args:
        key_codec: factory of the keys' codec.
        value_codec: factory of the values' codec.
        sink_tokens: number of first tokens kept raw (attention sinks), in the model's dtype or fp16 if wider.
        rope: when given, keys are coded before RoPE, in its canonical channel order (see `hf_deltakv.rope`).
        positions: a shared log of position ids (needed with `rope`), one per cache.
        window: the layer's sliding window (None: full attention).
    """

    def __init__(
        self,
        key_codec: Callable[[], StreamCodec],
        value_codec: Callable[[], StreamCodec],
        sink_tokens: int = 0,
        rope: RopeForm | None = None,
        positions: PositionLog | None = None,
        window: int | None = None,
    ) -> None:
        self._make_key_codec, self._make_value_codec = key_codec, value_codec
        super().__init__(sink_tokens, rope, positions, window)

    def _clear_stream(self) -> None:
        self.key_codec = self._make_key_codec()
        self.value_codec = self._make_value_codec()

    def _state_objects(self) -> list[object]:
        codecs = [self.key_codec, self.value_codec]
        codecs += [c.inner for c in codecs if hasattr(c, "inner")]
        return [*super()._state_objects(), *codecs]

    def _room_ahead(self, start: int, new: int) -> int:
        """Tokens to hold room for when one token is decoded at position `start`: those up to the end of its key group,
        and on the step that completes a group the next group's too. Storage then grows only on that step (and on the
        first after a prompt), never on the steps between: a decoding step's launches stay few on every step. (None
        for streams under `ROOM_AHEAD_GROUPS` groups.)"""
        group = getattr(self.key_codec, "group", None)
        if new != 1 or group is None or self.key_codec.length < ROOM_AHEAD_GROUPS * group:  # short: grow as needed
            return 0
        left = group - start % group  # (groups are aligned to absolute positions)
        return left + group if left == 1 else left

    def _append_stream(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        ahead = self._room_ahead(begin, keys.shape[2])
        if ahead:
            self.value_codec.ensure_room(ahead)
        turn = None
        if self.rope is not None:  # keys are coded before RoPE: turned back by their positions on the way in
            turn = (self.positions.at(keys.device)[:, begin : begin + keys.shape[2]], *self.rope.on(keys.device))
        self.key_codec.append_model(keys, turn)
        self.value_codec.append_model(values)

    def _stream_begin(self) -> int:
        """Position of the stream's first stored token."""
        return self.sink_tokens + self.evicted

    def _decode_stream(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.key_codec.length:
            return None
        keys = self.key_codec.decode()
        if self.rope is not None:
            ids = self.positions.at(self.device)[:, self._stream_begin() : self.cumulative_length]
            keys = self.rope.redo(keys, ids)
        return keys, self.value_codec.decode()

    def _decode_stream_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`kernels.decode_into` of both streams: on GPUs one kernel each, writing the model's dtype directly."""
        rope, order = None, None
        if self.rope is not None:
            rope = self._rope_angles(self._stream_begin(), self.cumulative_length)
            order = self.rope.on(keys.device)[1]
        kernels.decode_into(self.key_codec.layout(), keys, rope, order)
        kernels.decode_into(self.value_codec.layout(), values)

    def _observe_queries(self, query: torch.Tensor, positions: int) -> None:
        if not self.key_codec.observes_queries:
            return
        order = self.rope.on(query.device)[1] if self.rope is not None else None
        first = self.cumulative_length - positions
        if positions == 1:  # a decoding step: one kernel adds the queries' energies to the running sum
            self.key_codec.observe_one(query, order, self.kv_heads, first)
        elif positions <= self.attend_max_queries:  # a chunk: one kernel, each position's running sum
            self.key_codec.observe_chunk(query, order, self.kv_heads, first)
        else:
            self.key_codec.observe(kernels.query_energy(query, order, self.kv_heads, False), first)

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Through `kernels.stream_attention`: the fused kernel where one applies, else the chunked reference."""
        stored = self.key_codec.length
        if not stored or (mask is not None and mask.shape[1] != 1):  # per-head masks: the generic chunked path
            return super().attend(query, mask, scale)
        batch, q_heads, n, dim = query.shape
        mask = self._stored_mask(mask, n)
        rope = None
        group = q_heads // self.kv_heads
        if self.sink_keys is not None:
            sink_keys, sink_values = self.sink_keys, self.sink_values
        else:
            sink_keys = query.new_empty(batch, self.kv_heads, 0, dim)
            sink_values = query.new_empty(batch, self.kv_heads, 0, self.value_dim)
        if self.rope is not None:  # stored keys are canonical: so are the queries and sinks they meet (q.k is kept)
            rope = self._rope_angles(self._stream_begin(), self.cumulative_length)
            query, sink_keys = self.rope.to_canonical(query), self.rope.to_canonical(sink_keys)
        out = kernels.stream_attention(
            query.unflatten(1, (self.kv_heads, group)),  # [B, kv heads, group, n, D]: a view, read through its strides
            sink_keys,
            sink_values,
            self.key_codec.layout(),
            self.value_codec.layout(),
            rope=rope,
            mask=mask[:, 0] if mask is not None else None,
            n_queries=n,
            causal_offset=self.cumulative_length - self._first_stored() - n,
            scale=scale,
        )
        return out.reshape(batch, q_heads, n, self.value_dim)

    def _stream_chunks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Keys (RoPE re-applied, in the model's channel order) and values of the stored stream, `CHUNK_TOKENS` at a
        time."""
        begin = self._stream_begin()
        for start in range(0, self.key_codec.length, CHUNK_TOKENS):
            end = min(start + CHUNK_TOKENS, self.key_codec.length)
            keys = self.key_codec.decode_range(start, end)
            if self.rope is not None:
                keys = self.rope.redo(keys, self.positions.at(self.device)[:, begin + start : begin + end])
            yield keys, self.value_codec.decode_range(start, end)

    def _drop_stream_front(self, tokens: int) -> int:
        """Drop whole pieces both codecs can drop (the smaller of what each can), so they stay aligned."""
        dropped = min(self.key_codec.droppable(tokens), self.value_codec.droppable(tokens))
        if dropped:
            self.key_codec.drop_front(dropped)
            self.value_codec.drop_front(dropped)
        return dropped

    def _truncate_stream(self, tokens: int) -> None:
        if tokens >= self.key_codec.length:  # nothing stored past the cut (e.g. every token is still a sink)
            return
        self.key_codec.truncate(tokens)
        self.value_codec.truncate(tokens)

    def _stream_held(self) -> list:
        return [*self.key_codec.held(), *self.value_codec.held()]

    def _map_stream(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.key_codec.map_batch(fn)
        self.value_codec.map_batch(fn)
