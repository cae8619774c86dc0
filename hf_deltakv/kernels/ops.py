"""Kernels as PyTorch ops (`torch.library`): what a compiled decoding step calls, tensors and scalars in, tensors
out, each with a fake implementation so that `torch.compile` traces it without running it.

`hf_deltakv::plain_attention` is attention over raw-per-token packed storage (`PlainStream`: the llama.cpp formats,
rotated or not), as `kernels.stream_attention` dispatches it (the C++ kernel on the CPU, Triton on GPUs, the
reference elsewhere). Inside a compiled graph the op is one opaque call: the dispatch runs when the graph runs.
"""

from __future__ import annotations

import torch

from ..quant import QuantizedTensor, get_format
from .hadamard import rotation_block
from .layout import PlainStream


def _stream(codes: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None, fmt: str, dim: int,
            rotate: bool) -> PlainStream:  # fmt: skip
    blocks = QuantizedTensor(get_format(fmt), dim, codes, scales, mins)
    return PlainStream(blocks, dim, codes.shape[2], rotation_block(dim) if rotate else 0)


@torch.library.custom_op("hf_deltakv::plain_attention", mutates_args=())
def plain_attention(
    query: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor | None,
    k_mins: torch.Tensor | None,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    k_format: str,
    v_format: str,
    value_dim: int,
    rotate: bool,
    scale: float,
) -> torch.Tensor:
    """Attention of `query` `[batch, kv_heads, group, n, dim]` over every slot of packed keys and values `[batch,
    kv_heads, slots, ...]` (codes, fp16 scales or None for f16, mins or None, in `k_format` / `v_format`,
    Hadamard-rotated with `rotate`) under `mask` bool `[batch, n, slots]` (True: may attend). Returns fp32 `[batch,
    kv_heads, group * n, value_dim]` (row `g * n + i`: query `i` of the kv head's `g`-th query head); a row that may
    attend nothing: 0."""
    from . import stream_attention

    batch, heads, _, n, dim = query.shape
    keys = _stream(k_codes, k_scales, k_mins, k_format, dim, rotate)
    values = _stream(v_codes, v_scales, v_mins, v_format, value_dim, rotate)
    sink_keys = query.new_empty(batch, heads, 0, dim, dtype=torch.float32)
    sink_values = query.new_empty(batch, heads, 0, value_dim, dtype=torch.float32)
    out = stream_attention(query, sink_keys, sink_values, keys, values, rope=None, mask=mask, n_queries=n,
                           causal_offset=keys.length - n, scale=scale)  # fmt: skip
    return out.float().contiguous()


@plain_attention.register_fake
def _(query, k_codes, k_scales, k_mins, v_codes, v_scales, v_mins, mask, *, k_format, v_format, value_dim, rotate,
      scale):  # fmt: skip
    batch, heads, group, n, _ = query.shape
    return query.new_empty(batch, heads, group * n, value_dim, dtype=torch.float32)
