"""What every stream codec provides: append tokens, describe its packed storage, count its bytes.

A stream is one of a layer's two tensors (keys or values), `[batch, kv_heads, seq, head_dim]`. Codecs own encoding
and their state (packed storage only); decoding is the op `kernels.decode_stream` over the codec's `layout()`, so the
PyTorch reference, the C++ and the Triton kernels all read one description of the storage. The layer decides what
to feed a codec (pre-RoPE, after the sink tokens).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from .. import kernels
from ..kernels.hadamard import rotate
from ..kernels.layout import ROOM_FRACTION, ROOM_MIN  # (the room growing stores keep)
from ..quant import QuantizedTensor, nbytes_of, owned, saturate_fp16

State = torch.Tensor | QuantizedTensor | None


class StreamCodec(ABC):
    """Packed storage of one stream; all state tensors have the batch as their first dimension."""

    def __init__(self) -> None:
        self.length = 0

    @abstractmethod
    def append(self, x: torch.Tensor) -> None:
        """Encode new tokens `x` `[batch, heads, new, dim]` (fp32) after those already stored."""

    def append_model(self, x: torch.Tensor, turn: tuple | None = None) -> None:
        """Encode new tokens as the model gives them (its dtype; keys after RoPE): `turn`, (positions `[batch, new]`,
        float64 frequencies, channel order or None) on their device, turns keys back to before RoPE first
        (`kernels.undo_rope`). Codecs with a fused path write them into their storage directly."""
        self.append(x.float() if turn is None else kernels.undo_rope(x.float(), *turn))

    def append_rotated(self, x: torch.Tensor, rotation: int) -> None:
        """Encode `hadamard.rotate(x)` (the rotation of `RotatedCodec`, a block of `rotation` channels): codecs that
        rotate inside their kernel take `x` as it is."""
        self.append(rotate(x))

    def append_turned(self, x: torch.Tensor, turn: tuple | None, rotation: int) -> None:
        """`append_rotated` of new tokens as the model gives them, turned back by their RoPE first (`turn`, as
        `append_model` takes it): what `RotatedCodec.append_model` asks; codecs that do both in a kernel override it."""
        self.append_rotated(x if turn is None else kernels.undo_rope(x.float(), *turn), rotation)

    @abstractmethod
    def layout(self) -> kernels.StreamLayout:
        """The packed storage as the ops read it (only once something is stored)."""

    observes_queries = False  # whether `observe` uses the queries (the layer computes their energies only then)

    def observe(self, energy: torch.Tensor, first: int) -> None:  # noqa: B027 - a hook most codecs leave empty
        """Queries' channel energies `[batch, heads, n, dim]` at absolute positions `first...` (see `adaptive`); most
        codecs ignore them."""

    def observe_one(self, query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, position: int) -> None:
        """`observe` of one position's queries `[batch, q_heads, rows, dim]` (a decoding step; `order`: the canonical
        channel order, or None)."""
        self.observe(kernels.query_energy(query, order, kv_heads, True), position)

    def observe_chunk(self, query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, first: int) -> None:
        """`observe` of a chunk's queries `[batch, q_heads, n, dim]` at positions `first...` (at most
        `layers.base.ATTEND_MAX_QUERIES` of them)."""
        self.observe(kernels.query_energy(query, order, kv_heads, False), first)

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

    def _reserve(self, name: str, add: int, make: Callable[[int], State], minimum: int = 0) -> tuple[State, int]:
        """The buffer behind state attribute `name` and the sequence row where `add` new rows go, grown first when it
        lacks room (a new buffer with room, `GrowingRows`; `make(rows)` allocates the first, exactly). Write the rows
        (a kernel writes them in place), then `_commit_rows`. `minimum`: the rows a grown buffer holds at least."""
        rows = self.__dict__.setdefault("_growing", {}).setdefault(name, GrowingRows())
        if rows.view is not getattr(self, name):  # replaced since (batch reorder, crop, drop): grow from it
            rows.reset(getattr(self, name))
        return rows.reserve(add, make, minimum)

    def _commit_rows(self, name: str, add: int) -> None:
        """State attribute `name` covers the `add` rows written into its buffer past it (`_reserve`)."""
        setattr(self, name, self._growing[name].extend(add))

    def _drop_rows(self, name: str, drop: int, keep_room: int = 0) -> None:
        """State attribute `name` without its first `drop` rows: when that is all of them and its buffer holds at most
        `keep_room` rows, the buffer is kept for the next rows (an empty view of it: a decoding step's room); else the
        rest is copied out (`quant.owned`) and the buffer let go."""
        rows = self.__dict__.get("_growing", {}).get(name)
        value = getattr(self, name)
        if rows is not None and rows.view is value and drop == _rows(value) and _rows(rows.buffer) <= keep_room:
            setattr(self, name, rows.clear())
        else:
            setattr(self, name, _map(value, lambda t: owned(t[:, :, drop:])))
            self._release_rows()

    def ensure_room(self, rows: int) -> None:
        """Room for `rows` more tokens in every buffer that grows by the token (grown now, with room, if short): a
        decoding step that codes a group grows what the steps up to the next one need, so those grow nothing."""
        for name, growing in self.__dict__.get("_growing", {}).items():
            if growing.view is getattr(self, name) and growing.view is not None and name in self.token_rows:
                growing.ensure(rows)
                setattr(self, name, growing.view)

    token_rows: tuple[str, ...] = ()  # state attributes with one row per token (`ensure_room` grows them)

    def _release_rows(self) -> None:
        """After state attributes were replaced (not appended to): let go of the buffers behind the old views, so that
        nothing is held that `nbytes` does not count."""
        for name, rows in self.__dict__.get("_growing", {}).items():
            if rows.view is not getattr(self, name):
                rows.reset(getattr(self, name))


_GROWTH: list[list] = []  # open `batched_growth` scopes: the row copies of the buffers grown inside each


@contextlib.contextmanager
def batched_growth():
    """Within: a grown buffer's stored rows are copied at the end, all in one `kernels.copy_rows` (one launch on a GPU
    for the tail, the values and the positions a step grows). What runs inside writes only the new rows of a grown
    buffer and reads none of its old ones."""
    _GROWTH.append([])
    try:
        yield
    finally:
        kernels.copy_rows(_GROWTH.pop())


def growth_pending() -> bool:
    """Whether the open `batched_growth` has row copies still to make (a grown buffer's old rows are not there yet)."""
    return bool(_GROWTH and _GROWTH[-1])


def settle_growth() -> None:
    """Make now the row copies the open `batched_growth` has pending (before something reads a grown buffer's old
    rows; one launch on a GPU)."""
    if growth_pending():
        kernels.copy_rows(_GROWTH[-1])
        _GROWTH[-1].clear()


def move_rows(grown: State, stored: State) -> None:
    """Copy `stored` into the first rows of `grown` (its new, larger buffer): now, or at the end of the open
    `batched_growth`."""
    pairs = (
        list(zip(stored.tensors(), grown.tensors(), strict=True))
        if isinstance(stored, QuantizedTensor)
        else [(stored, grown)]
    )
    if _GROWTH:
        _GROWTH[-1].extend(pairs)
    else:
        kernels.copy_rows(pairs)


# A decoding step of a grouped key stream (the adaptive keys) grows nothing between the steps that code a group: the
# raw tail keeps room for a group, the values and positions for the tokens up to the next group's end. Streams
# shorter than this many groups grow as above instead (room for a group ahead would be most of what they hold).
ROOM_AHEAD_GROUPS = 2


class RawTailCodec(StreamCodec):
    """A stream coded `group` tokens at a time: new tokens go raw (fp16) into `tail`, a buffer that keeps room for a
    whole group once decoding appends to it (a group's tokens are then never copied before they are coded)."""

    group: int
    tail: torch.Tensor | None

    def append(self, x: torch.Tensor) -> None:
        self._append_tail(x, lambda target, at: kernels.reference.write_rows(target, saturate_fp16(x), at))

    def append_model(self, x: torch.Tensor, turn: tuple | None = None) -> None:
        """New tokens as the model gives them, turned back by their RoPE (`turn`) and saturated to fp16 straight into
        the raw tail's room (`kernels.undo_rope_into`: one kernel on GPUs)."""
        positions, freqs, order = turn if turn is not None else (None, None, None)
        self._append_tail(x, lambda target, at: kernels.undo_rope_into(x, positions, freqs, order, target, at))

    def _append_tail(self, x: torch.Tensor, write) -> None:
        """`write(buffer, row)` writes the tokens `x` `[B, H, n, D]` into the tail's buffer."""
        batch, heads, n, dim = x.shape
        make = lambda rows: torch.empty(batch, heads, rows, dim, dtype=torch.float16, device=x.device)  # noqa: E731
        room = self.group if self.length >= ROOM_AHEAD_GROUPS * self.group else 0  # (short streams grow as needed)
        target, at = self._reserve("tail", n, make, minimum=room)
        write(target, at)
        self._commit_rows("tail", n)
        self.length += n


class GrowingRows:
    """Rows appended along the sequence dimension (2) into a buffer with room for more (`ROOM_FRACTION`), so that
    appending one token per decoding step does not copy the history each time. `view` holds the rows stored so far (a
    `tensor` or `QuantizedTensor` over the buffer's leading rows): what codecs keep as state, counted with its
    buffer."""

    def __init__(self) -> None:
        self.buffer: State = None
        self.view: State = None

    def reserve(self, add: int, make: Callable[[int], State], minimum: int = 0) -> tuple[State, int]:
        """(buffer, first new row) with room for `add` more rows: the first rows get a buffer of their own size
        (`make`), later ones a grown copy with `ROOM_FRACTION` of room (at least `minimum` rows in all)."""
        have = 0 if self.view is None else _rows(self.view)
        if self.buffer is None or self.view is None or _rows(self.buffer) < have + add:
            if self.view is None:
                grown = make(add)
            else:
                capacity = max(have + add + max(ROOM_MIN, (have + add) // ROOM_FRACTION), minimum)
                grown = _map(self.view, lambda t: t.new_empty(*t.shape[:2], capacity, *t.shape[3:]))
                move_rows(grown, self.view)
            self.buffer = grown
        return self.buffer, have

    def ensure(self, add: int) -> None:
        """Room for `add` more rows past the view (grown, copied once, with at least that much room)."""
        have = _rows(self.view)
        if self.buffer is None or _rows(self.buffer) < have + add:
            capacity = have + max(add, ROOM_MIN, have // ROOM_FRACTION)
            grown = _map(self.view, lambda t: t.new_empty(*t.shape[:2], capacity, *t.shape[3:]))
            move_rows(grown, self.view)
            self.buffer = grown
            self.view = _map(grown, lambda t: t[:, :, :have])

    def clear(self) -> State:
        """No rows stored, the buffer kept for the next ones."""
        self.view = _map(self.buffer, lambda t: t[:, :, :0])
        return self.view

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
