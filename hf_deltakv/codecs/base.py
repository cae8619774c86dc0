"""What every stream codec provides: append tokens, decode all of them, count its bytes.

A stream is one of a layer's two tensors (keys or values), `[batch, kv_heads, seq, head_dim]`. Codecs keep packed
storage only; the layer decides what to feed them (rotated, pre-RoPE, after the sink tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..quant import QuantizedTensor

State = torch.Tensor | QuantizedTensor | None


class StreamCodec(ABC):
    """Packed storage of one stream; all state tensors have the batch as their first dimension."""

    def __init__(self) -> None:
        self.length = 0

    @abstractmethod
    def append(self, x: torch.Tensor) -> None:
        """Encode new tokens `x` `[batch, heads, new, dim]` (fp32) after those already stored."""

    def decode(self) -> torch.Tensor:
        """Reconstruct every stored token, `[batch, heads, length, dim]` in fp32."""
        return self.decode_range(0, self.length)

    @abstractmethod
    def decode_range(self, start: int, end: int) -> torch.Tensor:
        """Reconstruct tokens `start <= t < end` only, `[batch, heads, end - start, dim]` in fp32.

        What attention reads chunk by chunk, so that no full-precision copy of the whole history is ever built.
        """

    @abstractmethod
    def state_names(self) -> tuple[str, ...]:
        """Attributes holding the state (tensors or `QuantizedTensor`s with the batch first)."""

    def nbytes(self) -> int:
        """Bytes of all state held."""
        total = 0
        for name in self.state_names():
            value = getattr(self, name)
            if isinstance(value, QuantizedTensor):
                total += value.nbytes()
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
        return total

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` to every state tensor along its batch dimension (beam reorder, batch selection)."""
        for name in self.state_names():
            value = getattr(self, name)
            if isinstance(value, QuantizedTensor):
                setattr(self, name, value.map(fn))
            elif isinstance(value, torch.Tensor):
                setattr(self, name, fn(value))


def check_range(start: int, end: int, length: int) -> None:
    if not 0 <= start <= end <= length:
        raise ValueError(f"token range [{start}, {end}) is outside the {length} stored tokens")


def slice_seq(state: State, start: int, end: int) -> State:
    """Tokens `start:end` along the sequence dimension (2) of a tensor or `QuantizedTensor`."""
    if isinstance(state, QuantizedTensor):
        return state.map(lambda t: t[:, :, start:end])
    return state[:, :, start:end]


def append_along_seq(stored: State, new: State) -> State:
    """Concatenate `new` after `stored` along the sequence dimension (2)."""
    if stored is None:
        return new
    if isinstance(stored, QuantizedTensor):
        return QuantizedTensor.cat([stored, new], dim=2)
    return torch.cat([stored, new], dim=2)
