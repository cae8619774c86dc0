"""Plain per-token block quantization: the llama.cpp `-ctk/-ctv` baseline."""

from __future__ import annotations

import torch

from .. import kernels
from ..quant import QuantizedTensor, check_search_scale, get_format, owned
from .base import StreamCodec


class PlainCodec(StreamCodec):
    """Each token quantized on its own in blocks of its head dimension.

    Args:
        fmt: block format name (`q4_0`, `q4_1`, `q8_0`, `f16`).
        search_scale: search each block's scale for the least error (q4_0 family and q3_0; `quant.quantize`).
    """

    def __init__(self, fmt: str, search_scale: bool = False) -> None:
        super().__init__()
        self.fmt = check_search_scale(fmt, search_scale).name
        self.search_scale = search_scale
        self.stored = None

    token_rows = ("stored",)

    def state_names(self) -> tuple[str, ...]:
        return ("stored",)

    def append(self, x: torch.Tensor) -> None:
        self.append_rotated(x, 0)

    def append_rotated(self, x: torch.Tensor, rotation: int) -> None:
        # New tokens are quantized straight into the room of the stored rows (`kernels.quantize_at`: the rotation,
        # the quantizer and the write are one kernel on GPUs; the same bytes everywhere).
        batch, heads, n, dim = x.shape
        fmt = get_format(self.fmt)
        target, at = self._reserve("stored", n, lambda rows: QuantizedTensor.empty(fmt, (batch, heads, rows), dim,
                                                                                    x.device))  # fmt: skip
        kernels.quantize_at(x, self.fmt, self.search_scale, target, at, rotation)
        self._commit_rows("stored", n)
        self.length += n

    def droppable(self, tokens: int) -> int:
        return min(tokens, self.length)

    def drop_front(self, tokens: int) -> None:
        self.stored = self.stored.map(lambda t: owned(t[:, :, tokens:]))  # the dropped rows are freed
        self._release_rows()
        self.length -= tokens

    def truncate(self, tokens: int) -> None:
        self.stored = self.stored.map(lambda t: owned(t[:, :, :tokens]))
        self._release_rows()
        self.length = tokens

    def layout(self) -> kernels.PlainStream:
        return kernels.PlainStream(self.stored, self.stored.dim, self.length)
