"""What every hf_deltakv cache layer shares: input checks, raw sink tokens, position ids and batch operations.

Subclasses own the storage of the tokens after the sinks: `_append_stream` receives them (keys after RoPE, as the
model passes them), `_decode_stream` gives back keys with RoPE and values, `_stream_held` lists what is held.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterator

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention.stored import HistoryDecodedWarning, stored_pair
from ..codecs.base import ROOM_FRACTION, ROOM_MIN, batched_growth, move_rows
from ..kernels.layout import RopeAngles
from ..kernels.online_softmax import OnlineSoftmax
from ..quant import FP16_MAX, nbytes_of, owned, saturate_fp16
from ..rope import RopeForm

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Queries per kv head up to which attention reads the packed storage (decoding, chunked prefill); with more (a
# prefill) the history is decoded once and attention runs on it, as fast as the model's own SDPA.
ATTEND_MAX_QUERIES = 64
# Attention implementations handed decoded tensors by `update` instead of `StoredKV` ones: flex_attention runs in a
# fully compiled graph, which cannot trace a tensor subclass that decodes on demand.
DECODED_FOR = ("flex_attention",)


def _check_states(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    for name, t in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a float32, float16 or bfloat16 tensor, got {got}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, kv_heads, seq, head_dim], got shape {tuple(t.shape)}")
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ValueError(f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} disagree")


class StreamLayer(CacheLayerMixin):
    """A cache layer: the first `sink_tokens` tokens raw, the rest in a subclass's storage (the stream).

    `update` stores the new tokens first and then returns every cached token the model may attend to, the new ones
    included, so attention always sees exactly what the cache stores. A sliding-window layer (`window`) evicts what
    no later query can see (at its storage's granularity: whole groups) and returns what transformers' own
    sliding-window layer returns: the last `window - 1` tokens before the new ones.

    Args:
        sink_tokens: number of first tokens kept raw (attention sinks), in the model's dtype or fp16 if wider.
        rope: this layer's RoPE, when the storage works on pre-RoPE keys (see `hf_deltakv.rope`).
        positions: a shared log of position ids (needed with `rope`), one per cache.
        window: the layer's sliding window (None: full attention).
    """

    is_compileable = False
    is_croppable = True
    attend_max_queries = ATTEND_MAX_QUERIES  # more queries than this: `sdpa` decodes the history instead

    def __init__(
        self,
        sink_tokens: int = 0,
        rope: RopeForm | None = None,
        positions: PositionLog | None = None,
        window: int | None = None,
    ):
        super().__init__()
        self.sink_tokens = sink_tokens
        self.rope = rope
        self.positions = positions
        self.window = window
        self.is_sliding = window is not None
        self.record_past = False
        self.forward: ForwardLog | None = None  # set by the cache: told when this layer's attention is done
        self.layer_index = -1
        self._clear()

    def _clear(self) -> None:
        self._clear_stream()
        self.sink_keys = self.sink_values = None
        self.cumulative_length = 0
        self.evicted = 0  # stream tokens dropped from the front (sliding window)
        self.visible = 0  # first position the current forward's queries may see
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size = key_states.shape[0]
        self.kv_heads, self.head_dim = key_states.shape[1], key_states.shape[3]
        self.value_dim = value_states.shape[3]
        # Raw tokens are kept in the model's dtype, but at most 16 bits (an fp32 model's go to fp16).
        self.sink_dtype = torch.float16 if self.dtype == torch.float32 else self.dtype
        self.is_initialized = True

    def _check_continuation(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New tokens must continue what is cached: same batch, heads, widths, dtype and device."""
        have = (self.batch_size, self.kv_heads, self.head_dim, self.value_dim, self.dtype, self.device)
        got = (*key_states.shape[:2], key_states.shape[3], value_states.shape[3], key_states.dtype, key_states.device)
        if have != got:
            names = ("batch", "kv_heads", "head_dim", "value_dim", "dtype", "device")
            diff = ", ".join(f"{n} {a} (new: {b})" for n, a, b in zip(names, have, got, strict=True) if a != b)
            raise ValueError(f"new tokens do not continue this cache layer: it holds {diff}; call reset() first")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens, then return the keys and values attention may read, the new ones included.

        Args:
            key_states: new keys `[batch, kv_heads, new, head_dim]` (after RoPE, as models pass them).
            value_states: new values `[batch, kv_heads, new, head_dim]`.
            kwargs: may hold `position_ids` (directly or under `kwargs`), used for pre-RoPE coding.

        Returns:
            keys and values `[batch, kv_heads, visible + new, head_dim]` in the input dtype, as `StoredKV` tensors:
            SDPA on them reads the packed storage (`sdpa`), anything else decodes it (`reconstruct`). A failed update
            leaves the layer as it was.
        """
        _check_states(key_states, value_states)
        if self.is_initialized:
            self._check_continuation(key_states, value_states)
        saved = self._saved_for_update()
        try:
            with batched_growth():  # the buffers this update grows are copied in one op
                self._update(key_states, value_states, kwargs)
        except BaseException:
            self._restore(saved)
            raise
        shape = (self.batch_size, self.kv_heads, self.cumulative_length - self.visible)
        pair = stored_pair(self, (*shape, self.head_dim), (*shape, self.value_dim), key_states.dtype, self.device)
        if self.attention_implementation in DECODED_FOR:  # decoded now, warned once (see `DECODED_FOR`)
            op = f"attn_implementation={self.attention_implementation!r}"
            return pair[0].decoded(op), pair[1].decoded(op)
        return pair

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> None:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.cumulative_length, key_states.shape[2]
        if self.window is not None:  # this forward's queries see positions from start - window + 1 on
            self.visible = max(start - self.window + 1, 0)
            self._evict(self.visible)
        if not new:
            return
        if self.rope is not None:
            ids = given_position_ids(kwargs, start, new, key_states)
            self.positions.record(start, new, ids, self._room_ahead(start, new))
        sink_new = min(max(self.sink_tokens - start, 0), new)
        if sink_new:
            sk, sv = self._to_sink(key_states[:, :, :sink_new]), self._to_sink(value_states[:, :, :sink_new])
            self.sink_keys = sk.clone() if self.sink_keys is None else torch.cat([self.sink_keys, sk], dim=2)
            self.sink_values = sv.clone() if self.sink_values is None else torch.cat([self.sink_values, sv], dim=2)
        if new > sink_new:
            self._append_stream(key_states[:, :, sink_new:], value_states[:, :, sink_new:], start + sink_new)
        self.cumulative_length += new

    def _to_sink(self, states: torch.Tensor) -> torch.Tensor:
        """Raw sink storage; fp16 saturates at its largest finite value, as the codecs' scales do (NaN stays NaN)."""
        if self.sink_dtype == torch.float16:
            states = states.clamp(-FP16_MAX, FP16_MAX)
        return states.to(self.sink_dtype)

    def _evict(self, visible: int) -> None:
        """Drop what lies before position `visible`: the sinks, then whole pieces of the stream's storage."""
        if visible >= self.sink_tokens and self.sink_keys is not None:
            self.sink_keys = self.sink_values = None
        want = visible - self.sink_tokens - self.evicted
        if want > 0:
            self.evicted += self._drop_stream_front(want)

    def _room_ahead(self, start: int, new: int) -> int:
        """Tokens of room to make before storing `new` tokens at position `start` (default: none, grow as needed)."""
        return 0

    def _drop_stream_front(self, tokens: int) -> int:
        """Drop up to `tokens` tokens from the front of the stream's storage; returns how many (default: none)."""
        return 0

    def _first_stored(self) -> int:
        """Position of the first token held (sinks included)."""
        return (0 if self.sink_keys is not None else self.sink_tokens) + self.evicted

    def _stored_mask(self, mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """A mask over the visible positions (`[batch, 1 | heads, n, visible + ...]`, None: causal) as a mask over
        every position held: the held positions before `visible` (at most a group, sliding layers) masked out."""
        leading = self.visible - self._first_stored()
        if leading <= 0:
            return mask
        length = self.cumulative_length - self.visible
        if mask is None:
            mask = torch.ones(n, length, dtype=torch.bool, device=self.device).tril(diagonal=length - n)
            mask = mask[None, None].expand(self.batch_size, 1, n, length)
        hidden = torch.zeros(*mask.shape[:-1], leading, dtype=torch.bool, device=mask.device)
        return torch.cat([hidden, mask], dim=-1)

    def _snapshot(self) -> list[tuple[object, dict]]:
        """Copies of this layer's and its storage's attributes, one level deep (dicts and lists copied; stored tensors
        are never changed in place, only replaced or appended past the rows a view covers)."""
        return [(obj, _attributes(obj)) for obj in (self, *self._state_objects())]

    def _saved_for_update(self) -> list[tuple[object, dict]]:
        """What a failed `update` restores: the snapshot the cache took of this layer when the forward started (its
        state is unchanged until its own update; only the shared position log has moved on since, so it is copied
        anew), else a new snapshot. Saves copying every layer's attributes twice per decoding step."""
        kept = self.forward.claim(self.layer_index) if self.forward is not None else None
        if kept is None:
            return self._snapshot()
        return [(obj, _attributes(obj) if obj is self.positions else attributes) for obj, attributes in kept]

    @staticmethod
    def _restore(saved: list[tuple[object, dict]]) -> None:
        for obj, attributes in saved:
            obj.__dict__.clear()
            obj.__dict__.update(attributes)
        for obj, _ in saved:  # buffers grown since hold rows no state refers to: let them go
            release = getattr(obj, "_release_rows", None)
            if release is not None:
                release()

    def _state_objects(self) -> list[object]:
        """Objects besides the layer whose attributes hold its state (codecs, the shared position log)."""
        return [self.positions] if self.positions is not None else []

    def sdpa(
        self,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor | None:
        """`scaled_dot_product_attention(query, keys, values, ...)` over this layer's history read from storage
        (`attend`), or None when the call is one to serve by decoding the history instead: a prefill (more than
        `ATTEND_MAX_QUERIES` queries), dropout, a float mask, or shapes SDPA itself would refuse."""
        batch, heads, n, dim = query.shape
        length = self.cumulative_length - self.visible
        if dropout_p or heads % self.kv_heads or (heads != self.kv_heads and not enable_gqa):
            return None
        if mask is not None:
            if mask.dtype != torch.bool or mask.dim() > 4:
                return None
            mask = mask.view(*[1] * (4 - mask.dim()), *mask.shape)
            if mask.shape[1] not in (1, heads):
                return None
            mask = mask.expand(batch, mask.shape[1], mask.shape[2], length)
        elif is_causal and n != length:  # SDPA's causal mask is top-left aligned: query i sees keys 0..i
            mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril()[None, None]
            mask = mask.expand(batch, 1, n, length)
        elif not is_causal and n > 1:
            mask = torch.ones(batch, 1, n, length, dtype=torch.bool, device=query.device)
        # Otherwise (one query, or causal over the whole history) `attend`'s own causal rule is SDPA's.
        # transformers packs one decoded token's GQA query heads as rows of its kv head (a mask over one query row).
        packed = mask is not None and mask.shape[2] == 1 and n > 1 and heads == self.kv_heads
        self._observe_queries(query, 1 if packed else n)
        if n > self.attend_max_queries:
            return None
        if mask is not None:
            mask = mask.expand(batch, mask.shape[1], n, length)
        return self.attend(query, mask, scale if scale is not None else dim**-0.5).to(query.dtype)

    def _observe_queries(self, query: torch.Tensor, positions: int) -> None:
        """Hand the queries (the last `positions` positions) to storage that places bits by them (default: none)."""

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention of `query` over every visible cached token, read from storage chunk by chunk.

        Args:
            query: `[batch, q_heads, n, head_dim]` (after RoPE).
            mask: bool `[batch, 1 | q_heads, n, visible tokens]`, True where allowed; None for causal.
            scale: softmax scale.

        Returns:
            `[batch, q_heads, n, value_dim]` in fp32.
        """
        mask = self._stored_mask(mask, query.shape[2])
        state = OnlineSoftmax(query, scale, mask, self.cumulative_length - self._first_stored())
        if self.sink_keys is not None:
            state.add(self.sink_keys, self.sink_values)
        for keys, values in self._stream_chunks():
            state.add(keys, values)
        return state.result()

    def _stream_chunks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Keys (with RoPE) and values of the stream's stored tokens, in order, in chunks (default: one)."""
        stream = self._decode_stream()
        if stream is not None:
            yield stream

    def _rope_angles(self, begin: int, end: int) -> RopeAngles:
        """The RoPE of tokens at positions `begin:end` of this layer (angles computed when used, never kept; the
        frequencies on the positions' device)."""
        ids = self.positions.at(self.device)[:, begin:end]
        return RopeAngles(ids, self.rope.on(self.device)[0])

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (with RoPE, as attention reads them) and values of every visible cached token, as the cache stores
        them (`[batch, kv_heads, tokens, dim]` in the model's dtype), written into one buffer each: the sinks, then
        the stream (`_decode_stream_into`), with no full-precision copy of the history beyond a chunk."""
        sinks = 0 if self.sink_keys is None else self.sink_keys.shape[2]
        held = sinks + self._stream_length()
        shape = (self.batch_size, self.kv_heads, held)
        keys = torch.empty(*shape, self.head_dim, dtype=self.dtype, device=self.device)
        values = torch.empty(*shape, self.value_dim, dtype=self.dtype, device=self.device)
        if sinks:
            keys[:, :, :sinks], values[:, :, :sinks] = self.sink_keys, self.sink_values
        if held > sinks:  # (a reconstruction may reach past the inputs' range: fp16 saturates, never inf)
            self._decode_stream_into(keys[:, :, sinks:], values[:, :, sinks:])
        leading = self.visible - self._first_stored()
        return (keys[:, :, leading:], values[:, :, leading:]) if leading > 0 else (keys, values)

    def _stream_length(self) -> int:
        """Tokens held in the stream."""
        return max(self.cumulative_length - self.sink_tokens, 0) - self.evicted

    def _decode_stream_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The stream's keys (with RoPE) and values written into `keys` and `values` (the model's dtype; default:
        decoded whole by `_decode_stream`, then converted)."""
        stream = self._decode_stream()
        convert = saturate_fp16 if self.dtype == torch.float16 else (lambda t: t.to(self.dtype))
        keys.copy_(convert(stream[0]))
        values.copy_(convert(stream[1]))

    @abstractmethod
    def _clear_stream(self) -> None:
        """Drop the storage of the tokens after the sinks."""

    @abstractmethod
    def _append_stream(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        """Store tokens `begin, begin + 1, ...` (keys after RoPE)."""

    @abstractmethod
    def _decode_stream(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys (with RoPE) and values of the stream's stored tokens, or None when there are none."""

    @abstractmethod
    def _stream_held(self) -> list:
        """The tensors held for the tokens after the sinks."""

    @abstractmethod
    def _map_stream(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` along the batch dimension of every stored tensor."""

    @abstractmethod
    def _truncate_stream(self, tokens: int) -> None:
        """Keep the stream's first `tokens` stored tokens only."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the next forward's mask covers, position of the first): transformers' own rule per layer kind."""
        if self.window is None:
            return self.cumulative_length + query_length, 0
        offset = max(self.cumulative_length - self.window + 1, 0)
        return self.cumulative_length - offset + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def reset(self) -> None:
        self._clear()

    def held(self) -> list:
        """Every tensor this layer holds (sink tokens and the subclass's storage), for counting bytes."""
        return [*self._stream_held(), self.sink_keys, self.sink_values]

    def nbytes(self) -> int:
        """Bytes of all state this layer holds: every storage behind `held()`, once each."""
        return nbytes_of(self.held())

    def num_elements(self) -> int:
        """Number of cached key and value scalars (every token the layer has cached, evicted ones included: what a
        cache of the model would hold is the reference for bits per element)."""
        if not self.is_initialized:
            return 0
        return self.batch_size * self.kv_heads * self.cumulative_length * (self.head_dim + self.value_dim)

    def bits_per_element(self) -> float:
        """8 × nbytes / cached key and value scalars (0 when empty)."""
        n = self.num_elements()
        return 8 * self.nbytes() / n if n else 0.0

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self._map_stream(fn)
        if self.sink_keys is not None:
            self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        # The new batch size is whatever `fn` does to a batch dimension.
        self.batch_size = fn(torch.empty(self.batch_size, 0, device=self.device)).shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search (packed storage is reindexed, never re-encoded)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)] if isinstance(indices, torch.Tensor) else t[indices])

    def read_done(self) -> None:
        """This forward's attention has read the layer: a sliding window drops now what the next forward's queries
        cannot see, so that it holds no more than its window (plus the group being coded) between forwards, a one-shot
        prefill included. Not while past recording is on (a crop may take the next query back)."""
        if self.window is not None and not self.record_past:
            self._evict(max(self.cumulative_length - self.window + 1, 0))
        if self.forward is not None:
            self.forward.read(self.layer_index)

    notices: set | None = None  # what this layer's cache has warned about (shared by its layers: once per cache)
    attention_implementation: str | None = None  # the model's, when the cache was given the model

    def decoded_outside_sdpa(self, op: str) -> None:
        """Something other than SDPA read this layer's history (`StoredKV`): warned once per cache."""
        if self.notices is None:
            self.notices = set()
        if "decoded" in self.notices:
            return
        self.notices.add("decoded")
        warnings.warn(
            f"a compressed cache's history was read by {op} instead of scaled_dot_product_attention: every such read "
            "decodes every cached token of the layer in the model's dtype (at each decoding step, the whole history of "
            "every layer: the memory and time the compression saves are spent again, and the adaptive keys no longer "
            "see the queries they place their bits by). attn_implementation='eager', 'flash_attention_2' and "
            "'flex_attention' read it so; load the model with attn_implementation='sdpa' (transformers' default) to "
            "attend straight from the packed storage. (Warned once per cache.)",
            HistoryDecodedWarning,
            stacklevel=2,
        )

    def activate_past_recording(self, **kwargs) -> None:
        """transformers asks sliding layers to keep what a crop may need (assisted decoding): evict only at the next
        update, what is out of the window of every query that a crop back to the current forward could bring."""
        self.record_past = True

    def crop(self, max_length: int) -> None:
        """Drop `-max_length` tokens from the end (transformers 5's semantics; 0 changes nothing); a positive value
        is the number of tokens to keep (the earlier `DynamicCache.crop`).

        Stored tokens before the cut keep their stored values; the closed-loop state of the storage is restored at the
        cut (see each codec's `truncate`). Tokens a sliding window has evicted cannot come back: cutting into them
        is refused.
        """
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise ValueError(f"crop takes an integer number of tokens, got {max_length!r}")
        keep = self.cumulative_length + max_length if max_length <= 0 else max_length
        if keep >= self.cumulative_length:
            return
        if keep < 0:
            raise ValueError(f"cannot crop {-max_length} tokens from a layer holding {self.cumulative_length}")
        if keep < self._first_stored():
            raise ValueError(
                f"cannot crop to {keep} tokens: this sliding-window layer has evicted the tokens before position "
                f"{self._first_stored()}"
            )
        saved = self._snapshot()
        try:
            if keep < self.sink_tokens and self.sink_keys is not None:
                self.sink_keys, self.sink_values = (
                    owned(self.sink_keys[:, :, :keep]),
                    owned(self.sink_values[:, :, :keep]),
                )
            self._truncate_stream(max(keep - self.sink_tokens - self.evicted, 0))
            self.cumulative_length = keep
            self.visible = min(self.visible, keep)
            if self.positions is not None:
                self.positions.truncate(keep)
        except BaseException:
            self._restore(saved)
            raise

    def offload(self) -> None:
        """Offloading is not supported; the packed cache is already small."""

    def prefetch(self) -> None:
        """Offloading is not supported; nothing to prefetch."""


def _attributes(obj: object) -> dict:
    """`obj`'s attributes, dicts and lists among them copied (one level deep)."""
    attributes = dict(vars(obj))
    for name, value in attributes.items():
        if isinstance(value, dict):
            attributes[name] = dict(value)
        elif isinstance(value, list):
            attributes[name] = list(value)
    return attributes


def given_position_ids(kwargs: dict, start: int | None, new: int, like: torch.Tensor) -> torch.Tensor | None:
    """Position ids `[batch, new]` on `like`'s device from the kwargs models pass to `Cache.update` (directly or
    under `kwargs`), else `start, start + 1, ...` (None when `start` is None)."""
    ids = kwargs.get("position_ids")
    if ids is None and isinstance(kwargs.get("kwargs"), dict):
        ids = kwargs["kwargs"].get("position_ids")
    if ids is None:
        if start is None:
            return None
        ids = torch.arange(start, start + new, device=like.device).unsqueeze(0)
    if ids.device != like.device:
        ids = ids.to(like.device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[-1] != new:
        raise ValueError(f"position_ids cover {ids.shape[-1]} tokens but {new} new tokens were given")
    return ids.expand(like.shape[0], new)


class ForwardLog:
    """The state of a cache's layers when the current forward started, shared by them, so that a forward stopped
    midway (an exception after some layers updated) can be undone: kept until the last layer's attention has read
    it, then let go (it holds what the forward replaced)."""

    def __init__(self) -> None:
        self.saved: tuple[int, list] | None = None  # (layers that existed, their attributes)
        self.last = -1  # the index of the layer whose read ends the forward
        self.unclaimed: dict[int, list] = {}  # layer index -> its entries of `saved`, until its update takes them

    def start(self, layers: int, saved: list, total: int, per_layer: dict[int, list]) -> None:
        self.saved, self.last, self.unclaimed = (layers, saved), total - 1, per_layer

    def claim(self, index: int) -> list | None:
        """Layer `index`'s entries of the starting state, once per forward (None: taken, or the layer is new)."""
        return self.unclaimed.pop(index, None)

    def read(self, index: int) -> None:
        if index == self.last:
            self.saved, self.unclaimed = None, {}


class PositionLog:
    """Position ids of every cached token, shared by all layers of a cache (int32 `[batch, seq]`, counted in bytes).

    Pre-RoPE coding needs each token's position to turn its reconstruction forward again; the first layer to see
    a token records it, so the cost is paid once per cache, not once per layer. RoPE angles are computed from these
    ids where needed (kernels, references): no table is kept. Ids are appended in place into a buffer with room (as
    `codecs.base.GrowingRows` does), so that recording a token copies nothing most of the time.

    The log lives on the device of the layer that first records; layers on other devices (a model split by
    `device_map`) read `at(device)`: a copy per device, brought up to date with the positions it lacks (a device-to-
    device copy of the new ids, once per forward and device, never through the host), its bytes counted as well.
    """

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        # device -> (ids, buffer with room): replaced, never changed in place, so a snapshot of the attributes holds
        self._copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, device: torch.device) -> torch.Tensor | None:
        """The ids on `device`: the log itself where it lives, elsewhere its copy there (see the class docstring)."""
        ids = self.ids
        if ids is None or ids.device == device:
            return ids
        copy, buffer = self._copies.get(device, (None, None))
        have, total = (0 if copy is None else copy.shape[1]), ids.shape[1]
        if have == total:
            return copy
        if have > total or buffer is None or buffer.shape[1] < total:
            have = 0 if have > total else have  # (longer than the log: cut since; copied anew)
            room = ids.shape[1] if self._buffer is None else self._buffer.shape[1]
            grown = torch.empty(ids.shape[0], max(room, total), dtype=torch.int32, device=device)
            if have:
                grown[:, :have].copy_(copy)
            buffer = grown
        buffer[:, have:total].copy_(ids[:, have:total])
        self._copies = {**self._copies, device: (buffer[:, :total], buffer)}
        return buffer[:, :total]

    def tensors(self) -> list[torch.Tensor]:
        """What the log holds: its ids and their copies on other devices."""
        return [t for t in (self.ids, *(copy for copy, _ in self._copies.values())) if t is not None]

    def record(self, start: int, new: int, ids: torch.Tensor, ahead: int = 0) -> None:
        """Record the positions `ids` `[batch, new]` of tokens `start...` (once: later layers find them recorded),
        keeping room for `ahead` positions from `start` on when the buffer has to grow (a layer's `_room_ahead`)."""
        have = 0 if self.ids is None else self.ids.shape[1]
        if have >= start + new:
            return
        if have != start:
            raise ValueError(f"position log holds {have} tokens but a layer appended at {start}")
        need = max(new, ahead)
        buffer = self._buffer
        stale = self.ids is None or buffer is None or self.ids.data_ptr() != buffer.data_ptr()
        if stale or buffer.shape[1] < have + need:
            room = 0 if self.ids is None else max(ROOM_MIN, (have + new) // ROOM_FRACTION)
            buffer = torch.empty(ids.shape[0], have + max(new + room, need), dtype=torch.int32, device=ids.device)
            if self.ids is not None:
                move_rows(buffer[:, None], self.ids[:, None])
            self._buffer = buffer
        buffer[:, have : have + new] = ids  # (converted to int32 by the copy)
        self.ids = buffer[:, : have + new]

    def nbytes(self) -> int:
        return nbytes_of(self.tensors())

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.ids is not None:
            self.ids, self._buffer, self._copies = fn(self.ids), None, {}

    def truncate(self, tokens: int) -> None:
        """Forget the positions from `tokens` on (a crop); every layer shares this log, so the first one cuts it."""
        if self.ids is not None and self.ids.shape[1] > tokens:
            self.ids, self._buffer, self._copies = owned(self.ids[:, :tokens]), None, {}

    def reset(self) -> None:
        self.ids = self._buffer = None
        self._copies = {}
