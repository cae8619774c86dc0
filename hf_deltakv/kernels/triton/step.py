"""Triton: a decoding step of a preallocated `DeltaKVCache` layer whose counters live on the device (`ops
.stream_append_dev` and `ops.adaptive_attention_dev`): the same launches every step, nothing read on the host, so a
CUDA graph can replay the step whole. Specification: `ops.stream_append` and `ops.adaptive_attention` (their host
counters' arithmetic, `common.step_state`; the same bytes and floats, tested under the interpreter).

The kernels are those of the host path, each told by `STATE` to read the counters (int64 `[4]`: `ops.TOKENS`,
`CODED`, `OBSERVED`, `BEFORE`) instead of its row numbers, and to write nothing where the host path would not run
it (a token into the sinks instead of the stream; no group completed; a position observed already):

- `append_step`: `append._undo_rope_kernel` (the position recorded; the key raw into the sinks, or turned back by
  its RoPE into the raw tail) and `append._quantize_rows_kernel` (the value raw into the sinks, or quantized into its
  row), then `_advance_kernel` (the tokens held + 1): 3 launches.
- `attention_step`: `adaptive_code._code_groups_kernel` (the group the newest token completed, if any), `append
  ._query_energies_kernel` (the query's energies into the running sum, and the sum the next group is placed by),
  `_advance_kernel` (groups coded, positions observed, position summed), then `adaptive_attention`'s split and merge
  kernels over grids sized for the capacity, the splits past the live ones empty: 5 launches.

A step past the capacity writes nothing; the tokens-held counter still advances, so the host refuses the next call
it checks (`layers.static`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Kind, QuantizedTensor, check_search_scale
from ..layout import AdaptiveStream, PlainStream, stored_inputs
from . import adaptive_code, append
from .adaptive_attention import adaptive_attention
from .common import EXACT, on_device, step_state


@triton.jit
def _advance_kernel(state_ptr, sinks, pad, group, capacity, lead, APPEND: tl.constexpr, WEIGHTS: tl.constexpr):
    """The counters after a step's append (`APPEND`: the tokens held + 1) or its attention's bookkeeping (a completed
    group counted; with `WEIGHTS` the position observed, and summed where the next group's sum was kept)."""
    if APPEND:
        tl.store(state_ptr, tl.load(state_ptr) + 1)
    else:
        held, coded, observed, summed, complete = step_state(state_ptr, sinks, pad, group, capacity)
        coded += complete.to(tl.int64)
        if WEIGHTS:
            new = held - 1 >= observed
            keep = new & (held % group == 0) & (held // group >= coded + lead)
            observed = tl.where(new, held, observed)
            summed = tl.where(keep, held, summed)
        tl.store(state_ptr + 1, coded)
        tl.store(state_ptr + 2, observed)
        tl.store(state_ptr + 3, summed)


def append_step(
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    tail: torch.Tensor,
    values: QuantizedTensor,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    state: torch.Tensor,
    *,
    group: int,
    pad: int,
    fmt: str,
    search_scale: bool,
    rotation: int,
) -> None:
    """`ops.stream_append` (one token `[batch, kv_heads, 1, dim]` into its slot) with the counters `state` on the
    device; `positions` int32 `[batch, max_cache_len]`."""
    batch, heads, _, dim = key.shape
    sinks, capacity = sink_keys.shape[2], positions.shape[1]
    rope, ids = freqs is not None, position_ids if position_ids is not None else positions
    sink_f16 = sink_keys.dtype == torch.float16
    on_device(append._undo_rope_kernel)[(1, batch * heads)](
        key, positions, freqs if rope else key, order if order is not None else key, tail, state, ids, sink_keys,
        heads, 0, 1, sinks, group, pad, capacity,
        *key.stride(), *positions.stride(), *tail.stride()[:3], ids.stride(0), *sink_keys.stride()[:3],
        D=dim, ROPE=rope, ORDER=order is not None, ROWS=1, STATE=True, IDS=position_ids is not None,
        SINK_F16=sink_f16, **EXACT,
    )  # fmt: skip
    form = check_search_scale(fmt, search_scale)
    codes = values.codes.view(torch.int8) if form.kind == Kind.Q8 else values.codes
    scales = values.scales if values.scales is not None else codes
    mins = values.mins if values.mins is not None else scales
    on_device(append._quantize_rows_kernel)[(1, batch * heads)](
        value, codes, scales, mins, state, sink_values,
        heads, 0, 1, sinks, group, pad, capacity,
        *value.stride(), *codes.stride()[:3], *scales.stride()[:3], *sink_values.stride()[:3],
        **append._quantize_constants(form, value.shape[-1], rotation, search_scale), ROWS=1, STATE=True,
        SINK_F16=sink_f16, **EXACT,
    )  # fmt: skip
    on_device(_advance_kernel)[(1,)](state, sinks, pad, group, capacity, 0, APPEND=True, WEIGHTS=False)


def attention_step(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tail: torch.Tensor,
    values: QuantizedTensor,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    energy: torch.Tensor,
    before: torch.Tensor,
    state: torch.Tensor,
    *,
    pad: int,
    total_bits: int,
    clip_range: bool,
    query_weights: bool,
    rotation: int,
    scale: float,
) -> torch.Tensor:
    """`ops.adaptive_attention` (a decoding step's `query` `[batch, heads, 1, dim]`: the bookkeeping, then attention
    over the layer's buffers `groups` (planes, depths, low, step), `tail`, `values`) with the counters `state` on the
    device. Returns fp32 `[batch, heads, 1, value_dim]`."""
    batch, heads, n, dim = query.shape
    if n != 1:
        raise ValueError(f"a decoding step with device counters takes one query per head, got {n}")
    kv_heads, sinks, capacity = sink_keys.shape[1], sink_keys.shape[2], positions.shape[1]
    planes, depths, low, step = groups
    group = planes.shape[-1] * 8
    lead = (sinks - pad) // group  # (groups before the stream's first: `ops.adaptive_attention`'s test)
    on_device(adaptive_code._code_groups_kernel)[(1, batch * kv_heads)](
        tail, before, planes, depths, low, step, state,
        kv_heads, pad, total_bits, 0, sinks, capacity,
        *tail.stride(), before.stride(0), before.stride(1), 0, *planes.stride()[:3], *depths.stride()[:3],
        *low.stride()[:3], *step.stride()[:3],
        **adaptive_code.code_constants(group, dim, clip_range), WEIGHTS=False, STATE=True,
        RECIPROCAL=query.device.type == "cuda", **EXACT,
    )  # fmt: skip
    if query_weights:
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, 1, dim)
        on_device(append._query_energies_kernel)[(batch * kv_heads,)](
            grouped, order if order is not None else grouped, energy, energy, state, before,
            kv_heads, 1, 0, group, 1, sinks, pad, capacity, lead, *grouped.stride(),
            GROUP=grouped.shape[2], D=dim, ORDER=order is not None, TOTAL=True, STATE=True, **EXACT,
        )  # fmt: skip
    on_device(_advance_kernel)[(1,)](state, sinks, pad, group, capacity, lead, APPEND=False, WEIGHTS=query_weights)
    stream = capacity - sinks
    keys = AdaptiveStream(planes=planes, bits=depths, low=low, step=step, tail=tail, group=group, offset=pad, dim=dim,
                          length=stream)  # fmt: skip
    plain = PlainStream(values, values.dim, stream, rotation)
    grouped, sink_k, rope = stored_inputs(query, sink_keys, positions, freqs, order)
    out = adaptive_attention(grouped, sink_k, sink_values, keys, plain, rope=rope, mask=mask, scale=scale,
                             state=(state, capacity))  # fmt: skip
    return out.reshape(batch, heads, 1, sink_values.shape[-1])
