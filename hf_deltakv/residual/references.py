"""References: which tokens are kept as anchors, and each token's base (mean of its nearest earlier references).

Tokens are counted from the first one after the sinks (stream index). Stream index `i` is a reference when
`i % stride == 0`, so token 0 always is one and every later token has at least one earlier reference. `stride=0`
means no references: the base is zero and the learned mean alone is subtracted. A token's
nearest references are searched by L2 distance over its concatenated pre-RoPE key and value (all heads), among
references at or before its own position only (causal: decoding never sees a reference from its future).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import QuantizedTensor, dequantize, quantize
from .compressor import ResidualLayout

MAX_REFERENCES = 2**15 - 1  # reference ids are stored as int16


def is_reference(stream_index: torch.Tensor, stride: int) -> torch.Tensor:
    if stride == 0:
        return torch.zeros_like(stream_index, dtype=torch.bool)
    return stream_index % stride == 0


def store_references(x: torch.Tensor, fmt: str):
    """Packed storage of references `[batch, n, 2 * dim]` in a block format (`f16` keeps them raw)."""
    return quantize(x.float(), fmt)


def load_references(stored) -> torch.Tensor:
    return dequantize(stored)


def nearest_references(
    x: torch.Tensor, token_index: torch.Tensor, refs: torch.Tensor, ref_index: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Ids (`int64 [batch, n, top_k]`, -1 where fewer references exist) of each token's nearest causal references.

    Args:
        x: tokens `[batch, n, 2 * dim]` (pre-RoPE keys and values, heads concatenated).
        token_index: stream index of each token `[n]`.
        refs: reconstructed references `[batch, r, 2 * dim]`.
        ref_index: stream index of each reference `[r]`.
        top_k: references to average.
    """
    if refs.shape[1] > MAX_REFERENCES:
        raise ValueError(f"more than {MAX_REFERENCES} references in one layer; use a larger stride")
    distance = torch.cdist(x.float(), refs.float())
    future = ref_index.view(1, 1, -1) > token_index.view(1, -1, 1)
    distance = distance.masked_fill(future, float("inf"))
    k = min(top_k, refs.shape[1])
    values, ids = distance.topk(k, dim=-1, largest=False)
    ids = ids.masked_fill(torch.isinf(values), -1)
    if k < top_k:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], top_k - k), -1)], dim=-1)
    return ids


def reference_mean(refs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean `[batch, n, 2 * dim]` of the references `ids` `[batch, n, k]` (entries -1 are left out)."""
    valid = (ids >= 0).to(refs.dtype)
    gathered = torch.gather(
        refs.unsqueeze(1).expand(-1, ids.shape[1], -1, -1),
        2,
        ids.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, refs.shape[-1]),
    )
    return (gathered * valid.unsqueeze(-1)).sum(2) / valid.sum(-1, keepdim=True).clamp_min(1)


def token_bases(
    x: torch.Tensor, token_index: torch.Tensor, refs: torch.Tensor | None, ref_index: torch.Tensor, top_k: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(reference ids or None when there are no references, base `[batch, n, 2 * dim]`) of tokens `x`."""
    if refs is None or refs.shape[1] == 0:
        return None, torch.zeros_like(x)
    ids = nearest_references(x, token_index, refs, ref_index, top_k)
    return ids, reference_mean(refs, ids)


def reference_count(start: int, n: int, stride: int) -> int:
    """How many of the stream indices `start .. start + n - 1` are references (host arithmetic)."""
    return 0 if stride == 0 or n <= 0 else -(-(start + n) // stride) - -(-start // stride)


def split_positions(start: int, n: int, stride: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(references, coded tokens): the positions (int64, in order) among `n` consecutive tokens from stream index
    `start`, made on `device` from their host-known counts (a stable sort of the reference flags, no `nonzero`: nothing
    is read back from the device)."""
    refs = reference_count(start, n, stride)
    flags = is_reference(torch.arange(start, start + n, device=device), stride)
    order = torch.argsort(flags.logical_not().to(torch.uint8), stable=True)
    return order[:refs], order[refs:]


@dataclass
class SplitTokens:
    """Tokens split into references and coded tokens (what the cache, training and fitting all start from)."""

    reference_at: torch.Tensor  # int64 [references]: their positions among the tokens
    coded_at: torch.Tensor  # int64 [coded]: the coded tokens' positions
    stored: QuantizedTensor | None  # the new references, packed (None: no reference among the tokens)
    ids: torch.Tensor | None  # [batch, coded, top_k]: each coded token's references (None without references)
    bases: torch.Tensor  # [batch, coded, 2 * dim]: what each coded token's residual is taken against


def split_tokens(
    x: torch.Tensor, start: int, layout: ResidualLayout, earlier: QuantizedTensor | None = None
) -> SplitTokens:
    """Split tokens `x` `[batch, n, 2 * dim]` at stream indices `start .. start + n - 1` into references, stored in
    `layout.reference_format`, and coded tokens with their bases: the mean of their `top_k` nearest causal
    references among the `earlier` stored ones and the new ones. No value is read back to the host."""
    ref_at, coded_at = split_positions(start, x.shape[1], layout.stride, x.device)
    stored = store_references(x.index_select(1, ref_at).detach(), layout.reference_format) if ref_at.numel() else None
    packed = [q for q in (earlier, stored) if q is not None]
    refs = load_references(QuantizedTensor.cat(packed, 1)) if packed else None
    ref_index = torch.arange(0 if refs is None else refs.shape[1], device=x.device) * layout.stride
    coded = x.index_select(1, coded_at).detach()
    ids, bases = token_bases(coded, coded_at + start, refs, ref_index, layout.top_k)
    return SplitTokens(ref_at, coded_at, stored, ids, bases)
