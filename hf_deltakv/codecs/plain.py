"""Plain per-token block quantization: the llama.cpp `-ctk/-ctv` baseline."""

from __future__ import annotations

import torch

from .. import kernels
from ..quant import SEARCHABLE_KINDS, get_format, owned
from .base import StreamCodec


class PlainCodec(StreamCodec):
    """Each token quantized on its own in blocks of its head dimension.

    Args:
        fmt: block format name (`q4_0`, `q4_1`, `q8_0`, `f16`).
        search_scale: search each block's scale for the least error (q4_0 family and q3_0; `quant.quantize`).
    """

    def __init__(self, fmt: str, search_scale: bool = False) -> None:
        super().__init__()
        self.fmt = get_format(fmt).name
        if search_scale and get_format(fmt).kind not in SEARCHABLE_KINDS:
            raise ValueError(f"search_scale applies to the q4_0 family and q3_0, not {fmt!r}")
        self.search_scale = search_scale
        self.stored = None

    def state_names(self) -> tuple[str, ...]:
        return ("stored",)

    def append(self, x: torch.Tensor) -> None:
        # A decoded token goes straight into the room of the stored rows (the dispatched kernel, same bytes); a
        # prefill, or a full buffer, through a new quantized tensor.
        room = self._room("stored", x.shape[2]) if x.shape[2] == 1 else None
        if room is not None:
            kernels.quantize_at(x, self.fmt, self.search_scale, *room)
            self._commit_rows("stored", x.shape[2])
        else:
            self._append_rows("stored", kernels.quantize(x, self.fmt, self.search_scale))
        self.length += x.shape[2]

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
