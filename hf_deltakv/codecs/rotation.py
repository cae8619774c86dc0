"""A codec that codes Hadamard-rotated head vectors (`kernels.hadamard`) and decodes back to the original basis."""

from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..kernels.hadamard import rotation_block
from .base import StreamCodec


class RotatedCodec(StreamCodec):
    """Wraps a codec so that it codes Hadamard-rotated head vectors; its layout carries the rotation, so every op
    decodes back to the original basis."""

    def __init__(self, inner: StreamCodec) -> None:  # no super().__init__(): the inner codec keeps the length
        self.inner = inner

    @classmethod
    def around(cls, make_inner) -> RotatedCodec:
        """A rotated codec around a fresh one from `make_inner` (a picklable factory: `partial(around, make)`)."""
        return cls(make_inner())

    @property
    def length(self) -> int:
        return self.inner.length

    def state_names(self) -> tuple[str, ...]:
        return ()

    def held(self) -> list:
        return self.inner.held()

    def map_batch(self, fn) -> None:
        self.inner.map_batch(fn)

    def append(self, x: torch.Tensor) -> None:
        self.inner.append_rotated(x, rotation_block(x.shape[-1]))

    def append_model(self, x: torch.Tensor, turn: tuple | None = None) -> None:
        self.inner.append_turned(x, turn, rotation_block(x.shape[-1]))

    def ensure_room(self, rows: int) -> None:
        self.inner.ensure_room(rows)

    def droppable(self, tokens: int) -> int:
        return self.inner.droppable(tokens)

    def drop_front(self, tokens: int) -> None:
        self.inner.drop_front(tokens)

    def truncate(self, tokens: int) -> None:
        self.inner.truncate(tokens)

    def layout(self) -> kernels.StreamLayout:
        inner = self.inner.layout()
        return dataclasses.replace(inner, rotation=rotation_block(inner.dim))
