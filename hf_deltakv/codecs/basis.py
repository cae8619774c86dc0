"""Values in each kv head's own directions, fitted on the prompt (issue 61; `kernels.basis`, the reference)."""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import basis
from ..quant import owned
from .base import StreamCodec

# `DeltaKVCache(values=...)` names of this coding: the fallback format it takes the bytes of (and its rate)
BASIS_VALUES = {f"basis-{fmt}": fmt for fmt in basis.FALLBACK.values()}


class BasisCodec(StreamCodec):
    """Every token of a kv head coded in the head's principal directions (bits water-filled over them, one fp16 scale)
    or, where that errs more, in the rotated blocks of `fmt`, in the same bytes (`kernels.basis`): 3.5 bits a value
    at q3_0, 4.5 at q4_0. The tables (mean, basis, spreads, bits: `[batch, heads, ...]`, held and counted) are fitted
    on the first tokens appended, a prompt's values, and kept for every later token (a next turn's, a decoding
    step's). Reference ops only: no kernel reads it yet, so attention decodes it chunk by chunk.

    Args:
        fmt: the fallback format, `q3_0` or `q4_0`.
        floor: the fewest bits a direction gets.
    """

    def __init__(self, fmt: str = "q3_0", floor: int = 2) -> None:
        super().__init__()
        if fmt not in basis.FALLBACK.values():
            raise ValueError(f"a basis coding falls back to one of {sorted(basis.FALLBACK.values())}, got {fmt!r}")
        self.fmt, self.floor = fmt, floor
        self.rows = self.mean = self.basis = self.spread = self.bits = None

    token_rows = ("rows",)

    def state_names(self) -> tuple[str, ...]:
        return ("rows", "mean", "basis", "spread", "bits")

    def tables(self) -> basis.BasisTables:
        return basis.BasisTables(self.mean, self.basis, self.spread, self.bits, self.fmt)

    def append(self, x: torch.Tensor) -> None:
        batch, heads, n, dim = x.shape
        if self.basis is not None and self.mean.shape[-1] != dim:
            raise ValueError(f"values of head width {dim} given to a stream of width {self.mean.shape[-1]}")
        tables = self.tables() if self.basis is not None else basis.fit_tables(x, self.fmt, self.floor)
        rows = basis.encode(x, tables)  # (before any state changes: a failure leaves the codec as it was)
        if self.basis is None:
            self.mean, self.basis, self.spread, self.bits = tables.tensors()
        size = basis.row_bytes(self.fmt, dim)
        make = lambda count: torch.empty(batch, heads, count, size, dtype=torch.uint8, device=x.device)  # noqa: E731
        target, at = self._reserve("rows", n, make)
        target[:, :, at : at + n] = rows
        self._commit_rows("rows", n)
        self.length += n

    def droppable(self, tokens: int) -> int:
        return min(tokens, self.length)

    def drop_front(self, tokens: int) -> None:
        self.rows = owned(self.rows[:, :, tokens:])  # the dropped rows are freed; the tables stay
        self._release_rows()
        self.length -= tokens

    def truncate(self, tokens: int) -> None:
        self.rows = owned(self.rows[:, :, :tokens])
        self._release_rows()
        self.length = tokens
        if not tokens:  # (nothing left: the next tokens are a new prompt, fitted anew)
            self.rows = self.mean = self.basis = self.spread = self.bits = None

    def layout(self) -> kernels.BasisStream:
        return kernels.BasisStream(self.rows, self.mean, self.basis, self.spread, self.bits, self.fmt,
                                   self.mean.shape[-1], self.length)  # fmt: skip
