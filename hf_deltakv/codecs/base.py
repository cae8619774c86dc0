"""What every stream codec provides: append tokens, describe its packed storage, count its bytes.

A stream is one of a layer's two tensors (keys or values), `[batch, kv_heads, seq, head_dim]`. Codecs own encoding
and their state (packed storage only); decoding is the op `kernels.decode_stream` over the codec's `layout()`, so the
PyTorch reference, the C++ and the Triton kernels all read one description of the storage. The layer decides what
to feed a codec (pre-RoPE, after the sink tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from .. import kernels
from ..kernels.reference import write_rows
from ..quant import QuantizedTensor, nbytes_of

State = torch.Tensor | QuantizedTensor | None


class StreamCodec(ABC):
    """Packed storage of one stream; all state tensors have the batch as their first dimension."""

    def __init__(self) -> None:
        self.length = 0

    @abstractmethod
    def append(self, x: torch.Tensor) -> None:
        """Encode new tokens `x` `[batch, heads, new, dim]` (fp32) after those already stored."""

    @abstractmethod
    def layout(self) -> kernels.StreamLayout:
        """The packed storage as the ops read it (only once something is stored)."""

    observes_queries = False  # whether `observe` uses the queries (the layer computes their energies only then)

    def observe(self, energy: torch.Tensor, first: int) -> None:  # noqa: B027 - a hook most codecs leave empty
        """Queries' channel energies `[batch, heads, n, dim]` at absolute positions `first...` (see `adaptive`); most
        codecs ignore them."""

    @abstractmethod
    def state_names(self) -> tuple[str, ...]:
        """Attributes holding the state (tensors or `QuantizedTensor`s with the batch first)."""

    def droppable(self, tokens: int) -> int:
        """How many of the first `tokens` stored tokens the storage can drop (whole pieces; default: none)."""
        return 0

    def drop_front(self, tokens: int) -> None:
        """Drop the first `tokens` stored tokens (a `droppable` amount): a sliding window has passed them."""
        if tokens:
            raise ValueError(f"{type(self).__name__} cannot drop stored tokens")

    @abstractmethod
    def truncate(self, tokens: int) -> None:
        """Keep the first `tokens` stored tokens only (a crop), restoring any closed-loop state at the cut."""

    def decode_range(self, start: int, end: int) -> torch.Tensor:
        """Reconstruct tokens `start <= t < end` only, `[batch, heads, end - start, dim]` in fp32."""
        return kernels.decode_stream(self.layout(), start, end)

    def decode(self) -> torch.Tensor:
        """Reconstruct every stored token, `[batch, heads, length, dim]` in fp32."""
        return self.decode_range(0, self.length)

    def held(self) -> list:
        """Every tensor (or `QuantizedTensor`) of state held, for counting bytes (`quant.nbytes_of`)."""
        return [getattr(self, name) for name in self.state_names()]

    def nbytes(self) -> int:
        """Bytes of all state held."""
        return nbytes_of(self.held())

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` to every state tensor along its batch dimension (beam reorder, batch selection)."""
        for name in self.state_names():
            value = getattr(self, name)
            if isinstance(value, QuantizedTensor):
                setattr(self, name, value.map(fn))
            elif isinstance(value, torch.Tensor):
                setattr(self, name, fn(value))
        self._release_rows()

    def _append_rows(self, name: str, new: State) -> None:
        """Append `new` after the state attribute `name` along the sequence, in a buffer with room (`GrowingRows`)
        kept for that attribute."""
        rows = self.__dict__.setdefault("_growing", {}).setdefault(name, GrowingRows())
        if rows.view is not getattr(self, name):  # replaced since (batch reorder, crop, drop): grow from it
            rows.reset(getattr(self, name))
        setattr(self, name, rows.append(new))

    def _room(self, name: str, add: int) -> tuple[State, int] | None:
        """The buffer behind state attribute `name` and the sequence row where `add` new rows go, when it already has
        room for them past the rows stored (None: append through `_append_rows`). Write the rows, then
        `_commit_rows`."""
        rows = self.__dict__.get("_growing", {}).get(name)
        if rows is None or rows.buffer is None or rows.view is None or rows.view is not getattr(self, name):
            return None
        have = _rows(rows.view)
        return (rows.buffer, have) if _rows(rows.buffer) >= have + add else None

    def _commit_rows(self, name: str, add: int) -> None:
        """State attribute `name` covers the `add` rows written into its buffer past it (`_room`)."""
        setattr(self, name, self._growing[name].extend(add))

    def _release_rows(self) -> None:
        """After state attributes were replaced (not appended to): let go of the buffers behind the old views, so that
        nothing is held that `nbytes` does not count."""
        for name, rows in self.__dict__.get("_growing", {}).items():
            if rows.view is not getattr(self, name):
                rows.reset(getattr(self, name))


# Room a growing store keeps for later appends (decoding), as a fraction of what it holds (at least ROOM_MIN tokens):
# appending a token then copies nothing most of the time, and a regrowth copies the history once per 1/ROOM_FRACTION
# of its length. The first append (a prefill) gets no room. The room is held memory, so `nbytes` counts it (the
# buffer's whole storage).
ROOM_FRACTION = 32
ROOM_MIN = 1


class GrowingRows:
    """Rows appended along the sequence dimension (2) into a buffer with room for more (`ROOM_FRACTION`), so that
    appending one token per decoding step does not copy the history each time. `view` holds the rows stored so far (a
    `tensor` or `QuantizedTensor` over the buffer's leading rows): what codecs keep as state, counted with its
    buffer."""

    def __init__(self) -> None:
        self.buffer: State = None
        self.view: State = None

    def append(self, new: State) -> State:
        have = 0 if self.view is None else _rows(self.view)
        add = _rows(new)
        if self.buffer is None or _rows(self.buffer) < have + add or self.view is None:
            room = 0 if self.view is None else max(ROOM_MIN, (have + add) // ROOM_FRACTION)
            capacity = have + add + room
            grown = _map(new, lambda t: t.new_empty(*t.shape[:2], capacity, *t.shape[3:]))
            if self.view is not None:
                write_rows(grown, self.view, 0)
            self.buffer = grown
        write_rows(self.buffer, new, have)
        return self.extend(add)

    def extend(self, add: int) -> State:
        """The view grown over `add` rows already written into the buffer past it."""
        have = 0 if self.view is None else _rows(self.view)
        self.view = _map(self.buffer, lambda t: t[:, :, : have + add])
        return self.view

    def reset(self, view: State) -> None:
        """The stored rows were replaced (a crop, a batch reorder): start a new buffer on the next append."""
        self.buffer, self.view = None, view


def _rows(state: State) -> int:
    return (state.codes if isinstance(state, QuantizedTensor) else state).shape[2]


def _map(state: State, fn):
    return state.map(fn) if isinstance(state, QuantizedTensor) else fn(state)


def append_along_seq(stored: State, new: State) -> State:
    """Concatenate `new` after `stored` along the sequence dimension (2)."""
    if stored is None:
        return new
    if isinstance(stored, QuantizedTensor):
        return QuantizedTensor.cat([stored, new], dim=2)
    return torch.cat([stored, new], dim=2)
