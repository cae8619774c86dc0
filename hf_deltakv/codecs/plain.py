"""Plain per-token block quantization: the llama.cpp `-ctk/-ctv` baseline."""

from __future__ import annotations

import torch

from .. import ops
from ..formats import get_format, quantize
from .base import StreamCodec, append_along_seq


class PlainCodec(StreamCodec):
    """Each token quantized on its own in blocks of its head dimension.

    Args:
        fmt: block format name (`q4_0`, `q4_1`, `q8_0`, `f16`).
    """

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = get_format(fmt).name
        self.stored = None

    def state_names(self) -> tuple[str, ...]:
        return ("stored",)

    def append(self, x: torch.Tensor) -> None:
        # One decoded token: the dispatched kernel (same bytes); a prefill: the vectorised reference.
        coded = ops.quantize(x, self.fmt) if x.shape[2] == 1 else quantize(x, self.fmt)
        self.stored = append_along_seq(self.stored, coded)
        self.length += x.shape[2]

    def layout(self) -> ops.PlainStream:
        return ops.PlainStream(self.stored, self.stored.dim, self.length)
