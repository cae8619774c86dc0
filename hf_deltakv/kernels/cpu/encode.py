"""Python side of the CPU encode kernels (`encode.cpp`): block quantization of new tokens into their storage and the
closed-loop delta step, byte-identical to `quant.quantize` and `reference.code_delta` (tested)."""

from __future__ import annotations

import torch

from ...quant import QuantizedTensor, get_format
from ...quant.blocks import SCALE_SEARCH
from ...quant.table import Kind
from ..hadamard import ROTATION_LIMIT, rotation_scale
from .stream_attention import EMPTY_DOUBLE, EMPTY_HALF, EMPTY_LONG


def divisors(fmt: str, search_scale: bool) -> list[float]:
    """The scale search's divisors as the kernel takes them (quant.quantize: `SCALE_SEARCH` by the format's code
    offset, 8 for the q4_0 family, 4 for q3_0), or none without the search."""
    if not search_scale:
        return []
    return [float(d) for d in SCALE_SEARCH[4 if get_format(fmt).kind == Kind.Q3_SYM else 8]]


def _packed(fmt: str, lead: torch.Size, dim: int, codes, scales, mins) -> QuantizedTensor:
    n_blocks = codes.shape[1]
    return QuantizedTensor(
        get_format(fmt),
        dim,
        codes.view(*lead, n_blocks, codes.shape[-1]),
        scales.view(*lead, n_blocks),
        mins.view(*lead, n_blocks) if mins.numel() else None,
    )


def quantize(x: torch.Tensor, fmt: str, extension, search_scale: bool = False) -> QuantizedTensor:
    """`quant.quantize(x, fmt, search_scale)` for fp32 `x [..., dim]`."""
    dim = x.shape[-1]
    codes, scales, mins = extension.quantize_rows(
        x.reshape(-1, dim).float().contiguous(), int(get_format(fmt).kind), get_format(fmt).block_size,
        divisors(fmt, search_scale),
    )  # fmt: skip
    return _packed(fmt, x.shape[:-1], dim, codes, scales, mins)


def quantize_at(
    x: torch.Tensor, fmt: str, search_scale: bool, target: QuantizedTensor, at: int, rotation: int, extension
) -> None:
    """`reference.quantize_at` for fp32 tokens `x [batch, heads, n, dim]` (rotated first when `rotation`, the Hadamard
    block, is not 0)."""
    kind, block = int(get_format(fmt).kind), get_format(fmt).block_size
    empty = target.codes.new_empty(0, dtype=torch.float16)
    rows = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads each row contiguous
    extension.quantize_rows_at(
        rows, kind, block, divisors(fmt, search_scale), target.codes, target.scales,
        empty if target.mins is None else target.mins, at, rotation, rotation_scale(rotation) if rotation else 1.0,
        ROTATION_LIMIT,
    )  # fmt: skip


def append_token(
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    counts: torch.Tensor,
    tail: torch.Tensor,
    row: int,
    sinks: int,
    values: QuantizedTensor,
    fmt: str,
    search_scale: bool,
    rotation: int,
    extension,
) -> None:
    """`reference.append_token` in one call of the kernel (`append_step`)."""
    ids = EMPTY_LONG if position_ids is None else position_ids[:, 0].long()
    extension.append_step(
        key, value, ids, positions, EMPTY_DOUBLE if freqs is None else freqs.to(torch.float64),
        EMPTY_LONG if order is None else order, counts, tail, row, sinks, int(get_format(fmt).kind),
        get_format(fmt).block_size, divisors(fmt, search_scale), values.codes, values.scales,
        EMPTY_HALF if values.mins is None else values.mins, rotation, rotation_scale(rotation) if rotation else 1.0,
        ROTATION_LIMIT,
    )  # fmt: skip


def code_delta(
    x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor, fmt: str, intra: bool, extension
) -> tuple[QuantizedTensor, torch.Tensor]:
    """`reference.code_delta` for fp32 tensors `[..., dim]` of one shape."""
    dim = x.shape[-1]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, dim).float().contiguous()

    block = get_format(fmt).block_size
    codes, scales, mins, recon = extension.code_delta_rows(
        rows(x), rows(base), rows(long_term), int(get_format(fmt).kind), block, intra
    )
    return _packed(fmt, x.shape[:-1], dim, codes, scales, mins), recon.view(x.shape)
