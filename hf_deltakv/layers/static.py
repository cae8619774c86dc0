"""A cache layer for compiled decoding: packed per-token storage preallocated to a capacity, written in place.

transformers' `StaticLayer` with its fp16/bf16 history replaced by block-quantized codes (`quant`): the storage of
`max_cache_len` tokens is allocated at the first update (zeros), marked as a static address, and every later update
writes its tokens' codes at positions read from the layer's `cumulative_length` *tensor* (no Python int changes
between steps, nothing grows), so a decoding step is one graph that `torch.compile` (and CUDA graphs) replay without
recompiling. The new tokens are coded as `QuantizedKVCache` codes them (the same bytes: `reference.quantize_at`'s
arithmetic, the Hadamard rotation first when asked).

Attention: in a decoding step `update` returns `attention.packed` placeholders, and SDPA on them reads the packed
storage through one op (`hf_deltakv::plain_attention`: the C++ kernel on the CPU, Triton on GPUs), over every slot
under transformers' mask (it spans `max_cache_len`, as for `StaticCache`; unwritten slots are zeros, masked). A
prompt or chunk of several tokens, or a model whose attention is not SDPA, gets the decoded capacity in the model's
dtype instead (unwritten slots decode to zeros).

`EagerPromptLayer` (below) does the same for the layers of our other caches: a decoding step is two ops over
preallocated storage, a prompt runs the eager layer. Its subclasses: `PackedDeltaLayer` (DeltaKVCache's adaptive
keys), `PackedChannelLayer` (KIVI's per-channel keys), `PackedTokenLayer` (DeltaKVCache's `keys="token"`), all three
`PackedStreamLayer`s (`PositionedLayer`s: the tokens' positions in a buffer the cache's layers share), and
`PackedKeptLayer` (StreamingLLM's and SnapKV's slots); `residual.static.PackedResidualLayer` is the learned cache's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers.cache_utils import StaticLayer

from .. import kernels
from ..attention.packed import packed_classes, packed_pair
from ..kernels import ops  # (registers the hf_deltakv ops)
from ..kernels.hadamard import rotate, rotation_block
from ..kernels.layout import SNAPSHOTS, DeltaRows
from ..quant import QuantizedTensor, check_search_scale, dequantize, get_format, quantize, saturate_fp16
from .base import given_position_ids


def _zeros(fmt_name: str, lead: tuple[int, ...], dim: int, device: torch.device) -> QuantizedTensor:
    """Storage of `[*lead, dim]` in `fmt_name`, zeroed: an unwritten slot decodes to exactly 0 (never NaN, which a
    masked attention weight of 0 would still turn into NaN)."""
    return QuantizedTensor.empty(get_format(fmt_name), lead, dim, device).map(torch.zeros_like)


class FixedBatch:
    """Batch operations of a layer whose storage (`tensors()`, batch first) keeps its addresses and batch size."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows of the batch reordered in place (the storage keeps its address)."""
        if self.is_initialized:
            for t in self.tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "a cache with max_cache_len keeps its batch size: expand the inputs before the prompt"
        )

    batch_select_indices = batch_repeat_interleave


class PackedStaticLayer(FixedBatch, StaticLayer):
    """`StaticLayer` holding keys and values packed (`k_format`, `v_format`), Hadamard-rotated first with `rotate`.

    Args:
        max_cache_len: tokens the layer can hold (its storage is allocated for all of them).
        k_format: block format of keys (`q4_0`, `q4_1`, `q8_0`, `q3_0`, `f16`, ...).
        v_format: block format of values.
        rotate: Hadamard-rotate head vectors before quantizing (decoded back on the way out).
        search_scale: search each block's scale for the least error (q4_0 family and q3_0).
    """

    def __init__(
        self,
        max_cache_len: int,
        k_format: str,
        v_format: str,
        rotate: bool = False,
        search_scale: bool = False,
        packed_attention: bool = True,
    ) -> None:
        super().__init__(max_cache_len)
        self.packed = packed_classes(self) if packed_attention else None
        self.formats = tuple(check_search_scale(fmt, search_scale).name for fmt in (k_format, v_format))
        self.rotate, self.search_scale = rotate, search_scale
        self.stored: tuple[QuantizedTensor, QuantizedTensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        lead = (self.batch_size, self.num_heads, self.max_cache_len)
        dims = (self.k_head_dim, self.v_head_dim)
        self.stored = tuple(_zeros(fmt, lead, dim, self.device) for fmt, dim in zip(self.formats, dims, strict=True))
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # (as StaticLayer: fixed addresses, no recompiles, CUDA graphs)
            for t in (*self.tensors(), self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (codes, scales, mins of keys and values)."""
        return [t for stored in self.stored or () for t in stored.tensors()]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Code the new tokens into their slots (after `cumulative_length`) and return keys and values `[batch, heads,
        max_cache_len, dim]` in the input dtype: for one new token `attention.packed` placeholders (SDPA on them
        reads the storage), else the decoded capacity."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if not torch.compiler.is_compiling() and int(self.cumulative_length) + n > self.max_cache_len:
            raise ValueError(
                f"this cache holds at most max_cache_len={self.max_cache_len} tokens; {int(self.cumulative_length)} "
                f"are held and {n} more were given: make the cache with a larger max_cache_len"
            )
        if torch.compiler.is_compiling():  # in the graph: at the positions the length tensor gives
            positions = torch.arange(n, device=self.device) + self.cumulative_length
            for stored, fmt, x in zip(self.stored, self.formats, (key_states, value_states), strict=True):
                new = quantize(rotate(x) if self.rotate else x.float(), fmt, self.search_scale)
                for target, rows in zip(stored.tensors(), new.tensors(), strict=True):
                    target.index_copy_(2, positions, rows)
        else:  # eager: the dispatched kernel (C++ on the CPU, Triton on GPUs), the same bytes (tested)
            at = int(self.cumulative_length)
            for stored, fmt, x in zip(self.stored, self.formats, (key_states, value_states), strict=True):
                kernels.quantize_at(
                    x, fmt, self.search_scale, stored, at, rotation_block(x.shape[-1]) if self.rotate else 0
                )
        self.cumulative_length.add_(n)
        if self.packed is not None and n == 1:  # a decoding step: SDPA on these reads the packed storage
            shape = (self.batch_size, self.num_heads, self.max_cache_len)
            return packed_pair(self.packed, (*shape, self.k_head_dim), (*shape, self.v_head_dim), self.dtype,
                               self.device)  # fmt: skip
        return self.decoded(0), self.decoded(1)

    def attend_packed(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """`scaled_dot_product_attention(query, keys, values, mask)` over every slot, read from the packed storage
        (`kernels.ops.plain_attention`). `query` `[batch, heads, n, dim]`: the layer's kv heads times a group (GQA's
        query heads, or transformers' `pack_gqa` rows as queries); `mask` bool `[batch | 1, 1, n, slots]` or None
        (causal: the slots held)."""
        batch, heads, n, _ = query.shape
        slots = self.max_cache_len
        if mask is None:
            last = self.cumulative_length - n + torch.arange(n, device=self.device)  # each query's last slot
            mask = (torch.arange(slots, device=self.device)[None] <= last[:, None])[None, None]
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != slots:
            raise RuntimeError(f"a compiled cache layer takes a mask [batch, 1, n, {slots}], got {tuple(mask.shape)}")
        keys, values = self.stored
        out = torch.ops.hf_deltakv.plain_attention(
            query.float().unflatten(1, (self.num_heads, heads // self.num_heads)),
            keys.codes,
            keys.scales,
            keys.mins,
            values.codes,
            values.scales,
            values.mins,
            mask[:, 0].expand(batch, n, slots),
            k_format=self.formats[0],
            v_format=self.formats[1],
            value_dim=self.v_head_dim,
            rotate=self.rotate,
            scale=float(scale),
        )
        return out.reshape(batch, heads, n, self.v_head_dim).to(query.dtype)

    def decoded(self, index: int) -> torch.Tensor:
        """Keys (0) or values (1) of every slot, decoded in the model's dtype (fp16 saturates)."""
        x = dequantize(self.stored[index])
        if self.rotate:
            x = rotate(x)  # (the rotation is its own inverse)
        return saturate_fp16(x) if self.dtype == torch.float16 else x.to(self.dtype)

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.tensors():
                t.zero_()
            self.cumulative_length.zero_()

    def nbytes(self) -> int:
        """Bytes held: the whole capacity's storage (allocated up front)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def used_nbytes(self) -> int:
        """Bytes of the slots written so far (what a cache grown as needed would hold)."""
        return self.nbytes() * int(self.cumulative_length) // self.max_cache_len


class EagerPromptLayer(FixedBatch, StaticLayer):
    """A layer of one of our eager caches (`inner`) with its storage preallocated to `max_cache_len` tokens, whose
    decoding step compiles: a decoding step (one token) is two ops over the preallocated storage, whose counters
    (`counts`, int64, the first the tokens held) are host tensors (`kernels.ops`): the subclass's append op in
    `update`, its attention op when SDPA reads the `attention.packed` placeholders `update` returns. They run the
    steps of the eager layer, through the same kernels, so the same bytes. A prompt or chunk of several tokens runs
    the eager layer itself (given the stored tokens first when it holds none: `_to_inner`), whose state then moves into
    the preallocated storage once its attention has read it (`_from_inner`); the eager layer then holds nothing.

    Args:
        inner: the eager layer.
        max_cache_len: tokens the layer can hold.
        counters: how many host counters the subclass's ops keep.
    """

    def __init__(self, inner, max_cache_len: int, counters: int) -> None:
        super().__init__(max_cache_len)
        self.inner = inner
        self.sinks = inner.sink_tokens
        self.packed = packed_classes(self)
        self.counts = torch.zeros(counters, dtype=torch.int64)  # host counters (see `kernels.ops`)
        self.cumulative_length = self.counts[ops.TOKENS]  # (a view: StaticLayer's length tensor)
        self.pair = None  # the eager layer's keys and values during a prompt (`update` to `attend_packed`)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The storage, zeroed, at static addresses: the raw sinks (fp16 for an fp32 model, else its dtype, as the
        eager layer keeps them) and the subclass's (`_make_storage`)."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = dim, value_dim = key_states.shape[-1], value_states.shape[-1]
        lead = (self.batch_size, self.num_heads)
        sink_dtype = torch.float16 if self.dtype == torch.float32 else self.dtype
        make = lambda *shape, dtype: torch.zeros(*lead, *shape, dtype=dtype, device=self.device)  # noqa: E731
        self.sink_keys = make(self.sinks, dim, dtype=sink_dtype)
        self.sink_values = make(self.sinks, value_dim, dtype=sink_dtype)
        self._make_storage(make, dim, value_dim)
        if not torch.compiler.is_compiling():
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _make_storage(self, make, dim: int, value_dim: int) -> None:
        """Allocate the subclass's storage (`make(*shape, dtype=)`: zeros `[batch, kv_heads, *shape]`)."""
        raise NotImplementedError

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return `attention.packed` placeholders `[batch, heads, max_cache_len, dim]` (SDPA on
        them is answered by `attend_packed`). One token: the subclass's op (`_append_step`); several (a prompt, not
        compiled): the eager layer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            held = int(self.counts[ops.TOKENS])
            if held + n > self.max_cache_len:
                raise ValueError(
                    f"this cache holds at most max_cache_len={self.max_cache_len} tokens; {held} are held and {n} "
                    "more were given: make the cache with a larger max_cache_len"
                )
            if n != 1:
                self._to_inner(key_states, value_states)
                try:
                    self.pair = self.inner.update(key_states, value_states, *args, **kwargs)
                except BaseException:
                    self.inner.reset()  # (the storage still holds every token: given again to the next chunk)
                    raise
                return self._placeholders()
            if self.inner.is_initialized:  # a chunk no attention read: its state into the storage first
                self.pair = None
                self._from_inner()
        elif n != 1:
            raise RuntimeError("a compiled step of this cache takes one token per sequence (compile the decoding only)")
        self._append_step(key_states, value_states, kwargs)
        return self._placeholders()

    def _append_step(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> None:
        """A decoding step's token into the storage (the subclass's op)."""
        raise NotImplementedError

    def _placeholders(self):
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        return packed_pair(self.packed, (*shape, self.k_head_dim), (*shape, self.v_head_dim), self.dtype, self.device)

    def attend_packed(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """`scaled_dot_product_attention(query, keys, values, mask)` over the tokens held (`attention.packed`)."""
        if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != self.max_cache_len):
            raise RuntimeError(
                f"a compiled cache layer takes a mask [batch, 1, n, {self.max_cache_len}], got {tuple(mask.shape)}"
            )
        if not torch.compiler.is_compiling() and self.pair is not None:  # a prompt: the eager layer's SDPA, then
            # its state into the storage
            pair, self.pair = self.pair, None
            held = pair[0].shape[2]
            gqa = query.shape[1] != self.num_heads
            masked = {"is_causal": True} if mask is None else {"attn_mask": mask[..., :held]}
            out = F.scaled_dot_product_attention(query, *pair, scale=scale, enable_gqa=gqa, **masked)
            self._from_inner()
            return out
        batch, _, n, _ = query.shape
        if mask is not None:
            mask = mask[:, 0].expand(batch, n, self.max_cache_len)
        return self._attend_step(query, mask, float(scale)).to(query.dtype)

    def _attend_step(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """A decoding step's attention (the subclass's op) under `mask` bool `[batch, n, max_cache_len]` (None:
        causal): fp32 `[batch, heads, n, value_dim]`."""
        raise NotImplementedError

    def _to_inner(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Before the eager layer takes a prompt or chunk: it holds the stored tokens (copies of them) when it holds
        none, as if it had stored them itself (its state set from the storage and the counters)."""
        inner = self.inner
        held = int(self.counts[ops.TOKENS])
        if inner.is_initialized or not held:
            return
        inner.lazy_initialization(key_states, value_states)
        inner.cumulative_length = held
        if self.sinks:
            sinks = min(held, self.sinks)
            inner.sink_keys, inner.sink_values = (t[:, :, :sinks].clone() for t in (self.sink_keys, self.sink_values))
        self._stream_to_inner(held - min(held, self.sinks))

    def _stream_to_inner(self, stream: int) -> None:
        """The eager layer's stream state set from the storage (`stream` tokens after the sinks)."""
        raise NotImplementedError

    def _sinks_from_inner(self) -> None:
        inner = self.inner
        if inner.sink_keys is not None:
            sinks = inner.sink_keys.shape[2]
            self.sink_keys[:, :, :sinks] = inner.sink_keys
            self.sink_values[:, :, :sinks] = inner.sink_values

    def _from_inner(self) -> None:
        """After the eager layer's attention has read a prompt: its state into the storage, the eager layer emptied."""
        raise NotImplementedError

    def crop(self, max_length: int) -> None:
        """Keep the first tokens (`StreamLayer.crop`'s semantics), through the eager layer."""
        if not self.is_initialized or not int(self.counts[ops.TOKENS]):
            return
        like = torch.empty(self.batch_size, self.num_heads, 0, self.k_head_dim, dtype=self.dtype, device=self.device)
        self._to_inner(like, like.new_empty(*like.shape[:3], self.v_head_dim))
        try:
            self.inner.crop(max_length)
        except BaseException:
            self.inner.reset()  # (a refused crop: the storage still holds every token)
            raise
        self._from_inner()

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.tensors():
                t.zero_()
        self.counts.zero_()
        self.inner.reset()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes held: the whole capacity's storage (allocated up front; a cache's shared positions not included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors()) if self.is_initialized else 0


class PositionedLayer(EagerPromptLayer):
    """An `EagerPromptLayer` whose tokens' positions are kept in the cache's shared buffer (`SharedPositions`), for
    keys coded before RoPE (the eager layer's position log set from it and read back).

    Args:
        inner, max_cache_len, counters: as `EagerPromptLayer`.
        shared: the cache's `SharedPositions` (one position buffer for every layer).
        last: the model's last layer (its prompt ends the forward: the eager position log is let go).
    """

    def __init__(self, inner, max_cache_len: int, counters: int, shared: SharedPositions, last: bool) -> None:
        super().__init__(inner, max_cache_len, counters)
        self.shared, self.last = shared, last

    def _make_positions(self) -> None:
        """The shared position buffer, and the eager layer's RoPE (frequencies float64, channel order) on the
        device (None, None: keys coded as given)."""
        self.positions = self.shared.buffer(self.batch_size, self.max_cache_len, self.device)
        rope = self.inner.rope
        self.freqs, self.order = rope.on(self.device) if rope is not None else (None, None)

    def _positions_to_inner(self, held: int) -> None:
        """The eager layer's position log set from the buffer, unless it holds the `held` tokens' already."""
        log = self.inner.positions if self.inner.rope is not None else None  # (keys after RoPE: no positions kept)
        if log is not None and (log.ids is None or log.ids.shape[1] != held):
            log.reset()
            log.record(0, held, self.positions[:, :held])

    def _positions_from_inner(self, held: int) -> None:
        """The eager layer's positions into the buffer (consecutive ones where it keeps none), then the eager layer
        emptied (and the shared log after the model's last layer)."""
        inner = self.inner
        if inner.rope is not None and inner.positions.ids is not None:
            self.positions[:, :held] = inner.positions.ids
        elif held:
            self.positions[:, :held] = torch.arange(held, dtype=torch.int32, device=self.device)
        inner.reset()
        if self.last and inner.positions is not None:
            inner.positions.reset()


class PackedStreamLayer(PositionedLayer):
    """A layer of a `CompressedKVCache` (raw sinks, then keys coded by the subclass's codec and values per token in a
    block format) with its storage preallocated to `max_cache_len` tokens, whose decoding step compiles
    (`EagerPromptLayer`). The keys' coding is the subclass's: `PackedDeltaLayer` (DeltaKVCache), `PackedChannelLayer`
    (KIVI), `PackedTokenLayer` (DeltaKVCache with `keys="token"`).

    Args:
        inner: the eager layer (values `PlainCodec`, maybe rotated; keys the subclass's codec, maybe rotated).
        max_cache_len: tokens the layer can hold.
        shared, last: as `PositionedLayer`.
    """

    counters = 4  # (`kernels.ops`: TOKENS and the subclass's)
    serves = "a CompressedKVCache's coding"  # (what the subclass serves, for the error below)

    def __init__(self, inner, max_cache_len: int, shared: SharedPositions, last: bool) -> None:
        super().__init__(inner, max_cache_len, self.counters, shared, last)
        from ..codecs.plain import PlainCodec
        from ..codecs.rotation import RotatedCodec

        values, keys = inner.value_codec, inner.key_codec
        self.rotated = isinstance(values, RotatedCodec)
        plain = values.inner if self.rotated else values
        self.keys_rotated = isinstance(keys, RotatedCodec)
        if not isinstance(plain, PlainCodec) or not self._serves(keys.inner if self.keys_rotated else keys):
            raise ValueError(f"max_cache_len serves {self.serves}")
        if inner.window:
            raise ValueError("max_cache_len serves full-attention layers")
        self.v_format, self.search_scale = plain.fmt, plain.search_scale

    def _serves(self, keys) -> bool:
        """Whether the subclass serves the eager layer's key codec (its inner codec when rotated)."""
        raise NotImplementedError

    def key_codec(self):
        """The eager layer's key codec (its inner codec when rotated)."""
        keys = self.inner.key_codec
        return keys.inner if self.keys_rotated else keys

    def _make_keys(self, make, stream: int, dim: int) -> None:
        """Allocate the keys' storage for `stream` tokens after the sinks (`make(*shape, dtype=)`: zeros `[batch,
        kv_heads, *shape]`)."""
        raise NotImplementedError

    def key_tensors(self) -> list[torch.Tensor]:
        """The keys' storage (and coder state)."""
        raise NotImplementedError

    def _make_storage(self, make, dim: int, value_dim: int) -> None:
        stream = max(self.max_cache_len - self.sinks, 0)
        self._make_keys(make, stream, dim)
        self.values = _zeros(self.v_format, (self.batch_size, self.num_heads, stream), value_dim, self.device)
        self._make_positions()

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (batch first; the shared positions, the cache's to reorder once, not included)."""
        return [self.sink_keys, self.sink_values, *self.key_tensors(), *self.values.tensors()]

    def _options(self) -> dict:
        return {"v_format": self.v_format, "rotation": rotation_block(self.v_head_dim) if self.rotated else 0}

    def _stream_to_inner(self, stream: int) -> None:
        inner, held = self.inner, int(self.counts[ops.TOKENS])
        self._keys_to_inner(self.key_codec(), stream)
        plain = inner.value_codec.inner if self.rotated else inner.value_codec
        plain.stored, plain.length = self.values.map(lambda t: t[:, :, :stream].clone()), stream
        self._positions_to_inner(held)

    def _keys_to_inner(self, keys, stream: int) -> None:
        """The eager key codec's state set from the storage (`stream` tokens after the sinks)."""
        raise NotImplementedError

    def _from_inner(self) -> None:
        """After the eager layer's attention has read a prompt: its state into the storage (the key groups it
        completed are coded by then), the eager layer emptied."""
        inner = self.inner
        keys = self.key_codec()
        if keys.length:  # (a prompt no longer than the sinks leaves the key codec empty)
            keys.layout()  # (codes the complete groups, as the next read would)
        held = inner.cumulative_length
        self._sinks_from_inner()
        rest = self._keys_from_inner(keys)
        plain = inner.value_codec.inner if self.rotated else inner.value_codec
        if plain.stored is not None:
            for stored, rows in zip(self.values.tensors(), plain.stored.tensors(), strict=True):
                stored[:, :, : plain.length] = rows
        self.counts.copy_(torch.tensor([held, *rest]))
        self._positions_from_inner(held)

    def _keys_from_inner(self, keys) -> tuple[int, ...]:
        """The eager key codec's state into the storage; returns the subclass's counters."""
        raise NotImplementedError

    def used_nbytes(self) -> int:
        """Bytes of what the tokens held fill: the sinks, the keys' codes (and coder state), the values written (what
        the eager layer holds for them, less its buffers' room)."""
        if not self.is_initialized:
            return 0
        held = int(self.counts[ops.TOKENS])
        stream = max(held - self.sinks, 0)
        used = [_rows(t, min(held, self.sinks)) for t in (self.sink_keys, self.sink_values)]
        return sum(used) + sum(_rows(t, stream) for t in self.values.tensors()) + self._used_key_bytes(stream)

    def _used_key_bytes(self, stream: int) -> int:
        """Bytes of the keys' storage `stream` tokens fill (and the coder state)."""
        raise NotImplementedError


def _rows(t: torch.Tensor, n: int) -> int:
    """Bytes of the first `n` rows (dimension 2) of `t`."""
    return t.numel() // max(t.shape[2], 1) * n * t.element_size()


class GroupedKeysLayer(PackedStreamLayer):
    """Keys coded by groups of `group` tokens, the open group's tokens raw (fp16 `tail`): a decoding step is
    `kernels.ops.stream_append` (the key into the tail, the value coded), then the subclass's attention op (which codes
    the group the token completes). Subclasses: `PackedDeltaLayer`, `PackedChannelLayer`."""

    def _serves(self, keys) -> bool:
        self.group, self.pad = keys.group, getattr(keys, "pad", 0)  # (the stream's first group starts `pad` early)
        return True

    def _make_keys(self, make, stream: int, dim: int) -> None:
        self._make_groups(make, -(-(self.pad + stream) // self.group), dim)
        self.tail = make(self.group, dim, dtype=torch.float16)

    def _make_groups(self, make, groups: int, dim: int) -> None:
        """Allocate the storage of `groups` coded groups."""
        raise NotImplementedError

    def key_tensors(self) -> list[torch.Tensor]:
        return [*self.group_tensors(), self.tail]

    def group_tensors(self) -> list[torch.Tensor]:
        """The coded groups' storage (and coder state)."""
        raise NotImplementedError

    def _make_storage(self, make, dim: int, value_dim: int) -> None:
        super()._make_storage(make, dim, value_dim)
        # The ops' forms: counters on the device where the subclass's step runs there (`_device_step`: the `_dev`
        # ops, a GPU's); else the ops' C++ kernels where they serve (one call a step on the CPU): their arguments, or
        # None: the Python bodies.
        self.device_step = self._device_step(dim, value_dim)
        if self.device_step:
            self.counts = self.counts.to(self.device)
            self.cumulative_length = self.counts[ops.TOKENS]
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.counts)
        rotation = self._options()["rotation"]
        self.append_kernel = None if self.device_step else kernels.append_kernel_arguments(
            self.device, self.v_format, self.search_scale, rotation, dim, self.values)  # fmt: skip
        self.attention_kernel = None if self.device_step else self._attention_kernel(dim, value_dim)

    def _device_step(self, dim: int, value_dim: int) -> bool:
        """Whether the subclass's decoding step keeps its counters on the device (`kernels.device_step_serves`)."""
        return False

    def _attention_kernel(self, dim: int, value_dim: int) -> dict | None:
        """The C++ kernel's arguments of the subclass's attention op (`ops.with_kernel`), or None: its Python body."""
        return None

    def _append_step(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> None:
        ids = given_position_ids(kwargs, None, 1, key_states)  # (None: the op takes the count of tokens held)
        values = self.values
        kernel = self.append_kernel
        append = torch.ops.hf_deltakv.stream_append if kernel is None else torch.ops.hf_deltakv.stream_append_cpu
        append = torch.ops.hf_deltakv.stream_append_dev if self.device_step else append
        append(
            key_states, value_states, ids, self.sink_keys, self.sink_values, self.tail, values.codes, values.scales,
            values.mins, self.positions, self.freqs, self.order, self.counts, group=self.group, pad=self.pad,
            search_scale=self.search_scale, **self._options(), **(kernel or {}),
        )  # fmt: skip

    def _tail_start(self, coded: int) -> int:
        """The stream token the raw tail's first row holds when `coded` groups are coded."""
        return coded * self.group - self.pad if coded else 0

    def _keys_to_inner(self, keys, stream: int) -> None:
        coded = int(self.counts[ops.CODED])
        keys.tail = self.tail[:, :, : stream - self._tail_start(coded)].clone()
        keys.length = stream
        self._groups_to_inner(keys, coded)

    def _groups_to_inner(self, keys, coded: int) -> None:
        """The eager codec's coded groups (and coder state) set from the storage."""
        raise NotImplementedError

    def _keys_from_inner(self, keys) -> tuple[int, int, int]:
        if keys.tail is not None:
            self.tail[:, :, : keys.tail.shape[2]] = keys.tail
        return self._groups_from_inner(keys)

    def _groups_from_inner(self, keys) -> tuple[int, int, int]:
        """The eager codec's coded groups (and coder state) into the storage: (groups coded, and the subclass's
        OBSERVED and BEFORE counters)."""
        raise NotImplementedError

    def _used_key_bytes(self, stream: int) -> int:
        coded = int(self.counts[ops.CODED])
        return _rows(self.tail, stream - self._tail_start(coded)) + self._used_group_bytes(coded)

    def _used_group_bytes(self, coded: int) -> int:
        """Bytes of `coded` groups (and the coder state)."""
        raise NotImplementedError


class PackedDeltaLayer(GroupedKeysLayer):
    """A `DeltaKVCache` layer (adaptive per-channel key groups, per-token values) whose decoding step compiles
    (`GroupedKeysLayer`; its attention op `hf_deltakv::adaptive_attention`: the queries observed, the group the token
    completes coded at query-weighted depths). Args: as `PackedStreamLayer`."""

    serves = "DeltaKVCache's codings (values in a block format)"

    def _serves(self, keys) -> bool:
        from ..codecs.adaptive import AdaptiveChannelCodec

        if not isinstance(keys, AdaptiveChannelCodec) or keys.ranges != "fp16":
            return False
        self.first_group = keys.first_group
        self.clip_range, self.query_weights = keys.clip_range, keys.query_weights
        return super()._serves(keys)

    def _make_groups(self, make, groups: int, dim: int) -> None:
        self.total_bits = total = self.key_codec()._budget(dim)
        self.planes = make(groups, total, self.group // 8, dtype=torch.uint8)
        self.depths = make(groups, dim // 2, dtype=torch.uint8)
        self.low, self.step = (make(groups, dim, dtype=torch.float16) for _ in range(2))
        self.energy, self.before = (make(dim, dtype=torch.float32) for _ in range(2))

    def group_tensors(self) -> list[torch.Tensor]:
        return [self.planes, self.depths, self.low, self.step, self.energy, self.before]

    def _device_step(self, dim: int, value_dim: int) -> bool:
        return kernels.device_step_serves(self.device, self.v_format, dim, value_dim, self.group)

    def _attention_kernel(self, dim: int, value_dim: int) -> dict | None:
        return kernels.attention_kernel_arguments(self.device, self.v_format, dim, value_dim, self.group)

    def _attend_step(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        values = self.values
        kernel = self.attention_kernel
        attend = torch.ops.hf_deltakv.adaptive_attention
        attend = attend if kernel is None else torch.ops.hf_deltakv.adaptive_attention_cpu
        attend = torch.ops.hf_deltakv.adaptive_attention_dev if self.device_step else attend
        return attend(
            query, mask, self.sink_keys, self.sink_values, self.planes, self.depths, self.low, self.step, self.tail,
            values.codes, values.scales, values.mins, self.positions, self.freqs, self.order, self.energy,
            self.before, self.counts, pad=self.pad, total_bits=self.total_bits,
            clip_range=self.clip_range, query_weights=self.query_weights, scale=scale, **self._options(),
            **(kernel or {}),
        )  # fmt: skip

    def _groups_to_inner(self, keys, coded: int) -> None:
        _, _, observed, summed = self.counts.tolist()
        for name, stored in zip(("planes", "depths", "low", "step"), (self.planes, self.depths, self.low, self.step),
                                strict=True):  # fmt: skip
            setattr(keys, name, stored[:, :, :coded].clone() if coded else None)
        keys.coded = coded
        keys.energy, keys.observed = (self.energy.clone() if observed else None), observed
        open_group = self.first_group + coded
        keys.before_group = {open_group: (self.before.clone(), summed)} if summed else {}

    def _groups_from_inner(self, keys) -> tuple[int, int, int]:
        coded = keys.coded
        if coded:
            for stored, rows in zip((self.planes, self.depths, self.low, self.step),
                                    (keys.planes, keys.depths, keys.low, keys.step), strict=True):  # fmt: skip
                stored[:, :, :coded] = rows
        if keys.energy is not None:
            self.energy.copy_(keys.energy)
        open_group = self.first_group + coded
        summed = 0
        if open_group in keys.before_group:
            before, summed = keys.before_group[open_group]
            self.before.copy_(before)
        return coded, keys.observed, summed

    def _used_group_bytes(self, coded: int) -> int:
        return sum(_rows(t, coded) for t in (self.planes, self.depths, self.low, self.step)) + self.energy.nbytes * 2


class PackedChannelLayer(GroupedKeysLayer):
    """A `KIVIKVCache` layer (keys quantized per channel over groups of tokens, values per token) whose decoding step
    compiles (`GroupedKeysLayer`; its attention op `hf_deltakv::channel_attention`: the group the token completes
    quantized channel by channel). Args: as `PackedStreamLayer`."""

    serves = "KIVIKVCache's coding (keys per channel over groups of tokens, values in a block format)"

    def _serves(self, keys) -> bool:
        from ..codecs.channel import ChannelGroupCodec

        return isinstance(keys, ChannelGroupCodec) and super()._serves(keys)

    def _make_groups(self, make, groups: int, dim: int) -> None:
        fmt = self.key_codec().fmt
        self.k_format = fmt.name
        self.groups = _zeros(fmt.name, (self.batch_size, self.num_heads, groups, dim), self.group, self.device)

    def group_tensors(self) -> list[torch.Tensor]:
        return self.groups.tensors()

    def _attend_step(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        keys, values = self.groups, self.values
        return torch.ops.hf_deltakv.channel_attention(
            query, mask, self.sink_keys, self.sink_values, keys.codes, keys.scales, keys.mins, self.tail, values.codes,
            values.scales, values.mins, self.positions, self.freqs, self.order, self.counts, k_format=self.k_format,
            scale=scale, **self._options(),
        )  # fmt: skip

    def _groups_to_inner(self, keys, coded: int) -> None:
        keys.groups = self.groups.map(lambda t: t[:, :, :coded].clone()) if coded else None

    def _groups_from_inner(self, keys) -> tuple[int, int, int]:
        coded = keys._coded() // self.group
        if coded:
            for stored, rows in zip(self.groups.tensors(), keys.groups.tensors(), strict=True):
                stored[:, :, :coded] = rows
        return coded, 0, 0

    def _used_group_bytes(self, coded: int) -> int:
        return sum(_rows(t, coded) for t in self.groups.tensors())


class PackedTokenLayer(PackedStreamLayer):
    """A `DeltaKVCache` layer with `keys="token"` (a keyframe every `kf` tokens and closed-loop deltas, maybe rotated;
    per-token values) whose decoding step compiles (`PackedStreamLayer`: `kernels.ops.token_append`, then
    `kernels.ops.token_attention`). Args: as `PackedStreamLayer`."""

    counters = 1  # (the rows of keyframes, deltas and snapshots follow from the tokens held)
    serves = "DeltaKVCache's codings (values in a block format)"

    def _serves(self, keys) -> bool:
        from ..codecs.delta import DeltaCodec

        if not isinstance(keys, DeltaCodec):
            return False
        self.kf, self.reference, self.intra = keys.kf, keys.reference, keys.intra
        self.mean_reference = keys.mean_reference
        self.formats = (keys.keyframe_format, keys.delta_format)
        return True

    def _rows(self, stream: int) -> tuple[int, int, int]:
        """(keyframes, deltas, mean snapshots) of `stream` tokens."""
        return DeltaRows.counts(0, stream, self.kf, SNAPSHOTS, self.mean_reference)

    def _make_keys(self, make, stream: int, dim: int) -> None:
        keyframes, deltas, snapshots = self._rows(stream)
        lead = (self.batch_size, self.num_heads)
        self.keyframes = _zeros(self.formats[0], (*lead, keyframes), dim, self.device)
        self.deltas = _zeros(self.formats[1], (*lead, deltas), dim, self.device)
        self.means = make(snapshots, dim, dtype=torch.float16)
        self.state = make(1, dim, dtype=torch.float32)  # the closed loop's reference (the last reconstruction)
        self.running = make(1, dim, dtype=torch.float32)  # the sum of the inputs (for the mean snapshots)

    def key_tensors(self) -> list[torch.Tensor]:
        return [*self.keyframes.tensors(), *self.deltas.tensors(), self.means, self.state, self.running]

    def _key_args(self) -> tuple:
        keyframes, deltas = self.keyframes, self.deltas
        return (keyframes.codes, keyframes.scales, keyframes.mins, deltas.codes, deltas.scales, deltas.mins, self.means)

    def _key_options(self) -> dict:
        return {"kf": self.kf, "keyframe_format": self.formats[0], "delta_format": self.formats[1],
                "previous": self.reference == "previous", "intra": self.intra, "mean_reference": self.mean_reference,
                "key_rotation": rotation_block(self.k_head_dim) if self.keys_rotated else 0}  # fmt: skip

    def _append_step(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> None:
        ids = given_position_ids(kwargs, None, 1, key_states)
        values = self.values
        torch.ops.hf_deltakv.token_append(
            key_states, value_states, ids, self.sink_keys, self.sink_values, *self._key_args(), self.state,
            self.running, values.codes, values.scales, values.mins, self.positions, self.freqs, self.order,
            self.counts, search_scale=self.search_scale, **self._key_options(), **self._options(),
        )  # fmt: skip

    def _attend_step(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        values = self.values
        return torch.ops.hf_deltakv.token_attention(
            query, mask, self.sink_keys, self.sink_values, *self._key_args(), values.codes, values.scales,
            values.mins, self.positions, self.freqs, self.order, self.counts, scale=scale, **self._key_options(),
            **self._options(),
        )  # fmt: skip

    def _keys_to_inner(self, keys, stream: int) -> None:
        keyframes, deltas, snapshots = self._rows(stream)
        keys.keyframes = self.keyframes.map(lambda t: t[:, :, :keyframes].clone()) if keyframes else None
        keys.deltas = self.deltas.map(lambda t: t[:, :, :deltas].clone()) if deltas else None
        keys.means = self.means[:, :, :snapshots].clone() if snapshots else None
        keys.reference_state = self.state.clone() if stream else None
        keys.running_sum = self.running.clone() if stream and self.mean_reference else None
        keys.length = stream

    def _keys_from_inner(self, keys) -> tuple[int, ...]:
        for stored, rows in ((self.keyframes, keys.keyframes), (self.deltas, keys.deltas)):
            if rows is not None:
                for target, source in zip(stored.tensors(), rows.tensors(), strict=True):
                    target[:, :, : source.shape[2]] = source
        if keys.means is not None:
            self.means[:, :, : keys.means.shape[2]] = keys.means
        for target, state in ((self.state, keys.reference_state), (self.running, keys.running_sum)):
            if state is not None:
                target.copy_(state)
        return ()

    def _used_key_bytes(self, stream: int) -> int:
        keyframes, deltas, snapshots = self._rows(stream)
        used = sum(_rows(t, keyframes) for t in self.keyframes.tensors()) + _rows(self.means, snapshots)
        used += sum(_rows(t, deltas) for t in self.deltas.tensors())
        state = self.state.nbytes * (1 + self.mean_reference)  # (the loop's reference, and the running sum)
        return used + (state if stream else 0)


class PackedKeptLayer(EagerPromptLayer):
    """An evicting layer (`layers.evicting.EvictingLayer`: StreamingLLM, SnapKV) whose decoding step compiles
    (`EagerPromptLayer`): fp16 slots for the tokens kept, preallocated for the most the eager layer's buffers hold up to
    `max_cache_len` tokens seen (the budget, `keep` of them, and its room), each slot's position; a decoding step is
    `kernels.ops.kept_append`, then `kernels.ops.kept_attention_step` (attention, then the eviction). The same slots,
    compactions and tokens as the eager layer.

    Args:
        inner: the eager layer.
        max_cache_len: tokens the layer can see (the slots hold the budget of that many).
        shared, last: as `PackedStreamLayer` (unused: an evicting layer keeps its positions in its slots).
    """

    def __init__(self, inner, max_cache_len: int, shared=None, last: bool = False) -> None:
        from ..kernels.layout import ROOM_FRACTION, ROOM_MIN
        from .evicting import EvictingLayer

        super().__init__(inner, max_cache_len, 5)
        if not isinstance(inner, EvictingLayer) or inner.window:
            raise ValueError("max_cache_len serves StreamingLLMCache and SnapKVCache on full-attention layers")
        self.keep, self.recent, self.kernel = inner.keep, inner.recent, inner.kernel
        self.snapkv = inner.policy == "snapkv"
        budget = max(math.ceil(self.keep * max_cache_len) - self.sinks, self.recent)
        self.slots = budget + 2 * max(ROOM_MIN, (budget + 1) // ROOM_FRACTION) + 2  # (the eager layer's most)

    def _make_storage(self, make, dim: int, value_dim: int) -> None:
        self.keys = make(self.slots, dim, dtype=torch.float16)
        self.values = make(self.slots, value_dim, dtype=torch.float16)
        self.index = make(self.slots, dtype=torch.int32)

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (batch first)."""
        return [self.sink_keys, self.sink_values, self.keys, self.values, self.index]

    def _append_step(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> None:
        torch.ops.hf_deltakv.kept_append(key_states, value_states, self.sink_keys, self.sink_values, self.keys,
                                         self.values, self.index, self.counts)  # fmt: skip

    def _attend_step(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        return torch.ops.hf_deltakv.kept_attention_step(
            query, mask, self.sink_keys, self.sink_values, self.keys, self.values, self.index, self.counts,
            keep=float(self.keep), recent=self.recent, pool=self.kernel, snapkv=self.snapkv, scale=scale,
        )  # fmt: skip

    def _stream_to_inner(self, stream: int) -> None:
        inner = self.inner
        _, slots, first, live, _ = self.counts.tolist()
        if slots:  # (the eager layer compacts them at its next append: `_growing_slots` unset)
            stored = (self.keys, self.values, self.index)
            inner.keys, inner.values, inner.index = (t[:, :, :slots].clone() for t in stored)
            inner.first, inner.live = first, live

    def _from_inner(self) -> None:
        inner = self.inner
        self._sinks_from_inner()
        slots, end = 0, 0
        if inner.keys is not None:
            index = inner.index if inner.pending is None else inner.index.scatter(2, inner.pending, -1)
            slots = inner.keys.shape[2]
            for target, rows in ((self.keys, inner.keys), (self.values, inner.values), (self.index, index)):
                target[:, :, :slots] = rows
            grown = inner._growing_slots
            ours = grown is not None and grown[0].data_ptr() == inner.keys.data_ptr()
            end = min(grown[0].shape[2] if ours else slots, self.slots)
        self.counts.copy_(torch.tensor([inner.cumulative_length, slots, inner.first, inner.live, end]))
        inner.reset()

    def used_nbytes(self) -> int:
        """Bytes of what the tokens kept fill: the sinks seen and the slots used (what the eager layer holds, less its
        buffers' room)."""
        if not self.is_initialized:
            return 0
        seen, slots = self.counts.tolist()[:2]
        used = [_rows(t, min(seen, self.sinks)) for t in (self.sink_keys, self.sink_values)]
        return sum(used) + sum(_rows(t, slots) for t in (self.keys, self.values, self.index))


class SharedPositions:
    """The position ids of a cache's tokens (int32 `[batch, max_cache_len]`), one buffer for all its layers (made by
    the first layer that needs it; every layer's step writes its token's position there, the same value)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None

    def buffer(self, batch: int, capacity: int, device: torch.device) -> torch.Tensor:
        if self.ids is None or self.ids.shape[0] != batch or self.ids.device != device:
            self.ids = torch.zeros(batch, capacity, dtype=torch.int32, device=device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.ids)
        return self.ids

    def nbytes(self) -> int:
        return 0 if self.ids is None else self.ids.numel() * self.ids.element_size()
