"""Kernels as PyTorch ops (`torch.library`): what a compiled decoding step calls, tensors and scalars in, tensors
out, each with a fake implementation so that `torch.compile` traces it without running it.

`hf_deltakv::plain_attention` is attention over raw-per-token packed storage (`PlainStream`: the llama.cpp formats,
rotated or not), as `kernels.stream_attention` dispatches it (the C++ kernel on the CPU, Triton on GPUs, the
reference elsewhere). `hf_deltakv::stream_append` with `hf_deltakv::adaptive_attention` is a decoding step of a
`DeltaKVCache` layer over preallocated storage (below), with `hf_deltakv::channel_attention` one of a `KIVIKVCache`
layer; on the CPU the first two run as `stream_append_cpu` and `adaptive_attention_cpu` (`with_kernel`: C++ kernels
registered with the dispatcher, `cpu/step_ops.cpp`). Inside a compiled graph each op is one opaque call: the
dispatch runs when the graph runs.
"""

from __future__ import annotations

import inspect
import math
import re

import torch

from ..quant import FP16_MAX, QuantizedTensor, get_format
from .hadamard import rotation_block
from .layout import (
    ROOM_FRACTION,
    ROOM_MIN,
    SNAPSHOTS,
    AdaptiveStream,
    ChannelStream,
    DeltaRows,
    DeltaStream,
    KeptStream,
    PlainStream,
    stored_inputs,
)
from .online_softmax import OnlineSoftmax

_LIBRARY = torch.library.Library("hf_deltakv", "DEF")
DEFINED: list[str] = []  # the name of every op defined (`op`), here and in `residual.ops`


def op(mutates_args: tuple[str, ...] = ()):
    """Define `fn` as the op `hf_deltakv::<its name>` (the schema inferred from its annotations, `mutates_args` marked
    as written) through torch.library's low-level API: a call runs `fn` directly. (`torch.library.custom_op` wraps
    every call in Python, ~0.14 ms measured here, more than a decoding step's attention kernel over 1K tokens.)

    An op that takes the layer's host counters (an argument `counts`) reads and advances them on the host at every
    call, which a CUDA graph's replay would not do: it is tagged `cudagraph_unsafe`, so that inductor's graph
    partitioning (`mode="reduce-overhead"`) runs it outside the CUDA graphs, which replay the rest of the step."""

    def define(fn):
        host = "counts" in inspect.signature(fn).parameters
        tags = (torch.Tag.cudagraph_unsafe,) if host else ()
        _LIBRARY.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
        _LIBRARY.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        DEFINED.append(fn.__name__)
        return fn

    return define


def fake(fn):
    """`fn` as the fake implementation (shapes only, for tracing) of the op of its name without the leading `_`."""
    torch.library.register_fake(f"hf_deltakv::{fn.__name__.removeprefix('_')}", fn, lib=_LIBRARY)
    return fn


def _values(codes, scales, mins, fmt: str, dim: int) -> QuantizedTensor:
    """Packed storage as a `QuantizedTensor` (scales and mins None where the format has none)."""
    return QuantizedTensor(get_format(fmt), dim, codes, scales, mins)


def _stream(codes: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None, fmt: str, dim: int,
            rotate: bool) -> PlainStream:  # fmt: skip
    rotation = rotation_block(dim) if rotate else 0
    return PlainStream(_values(codes, scales, mins, fmt, dim), dim, codes.shape[2], rotation)


@op()
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


@fake
def _plain_attention(query, k_codes, k_scales, k_mins, v_codes, v_scales, v_mins, mask, *, k_format, v_format,
                     value_dim, rotate, scale):  # fmt: skip
    batch, heads, group, n, _ = query.shape
    return query.new_empty(batch, heads, group * n, value_dim, dtype=torch.float32)


# --- Grouped-key layers (`layers.static.PackedStreamLayer`: DeltaKVCache's, KIVIKVCache's) ----------------------
# A decoding step of such a layer is two ops over storage preallocated for `max_cache_len` tokens: `stream_append`
# (the new token into its slot) and the keys' attention op, `adaptive_attention` or `channel_attention` (the queries
# observed, the key group the token completes coded, attention read from the codes). Their counters, `counts` int64
# `[4]`, live on the host (read without a device sync): the tokens held (sinks included), the key groups coded, the
# query positions observed, and the position up to which the query energies kept in `before` were summed (0: none
# kept; the last two adaptive keys' only). The ops run the steps that `layers.compressed`, `codecs.adaptive`,
# `codecs.channel` and `codecs.plain` run eagerly, through the same dispatched kernels: the same bytes.
TOKENS, CODED, OBSERVED, BEFORE = range(4)


def to_sinks(
    key: torch.Tensor, value: torch.Tensor, sink_keys: torch.Tensor, sink_values: torch.Tensor, at: int
) -> None:
    """A token `[batch, kv_heads, 1, dim]` into row `at` of the raw sinks (fp16 saturates: `StreamLayer._to_sink`)."""
    for target, x in ((sink_keys, key), (sink_values, value)):
        x = x.clamp(-FP16_MAX, FP16_MAX) if target.dtype == torch.float16 else x
        target[:, :, at] = x[:, :, 0].to(target.dtype)


def _tail_row(stream_token: int, coded: int, group: int, pad: int) -> int:
    """The row of the raw tail where stream token `stream_token` sits (the tail holds the open group's tokens; the
    stream's first group starts `pad` slots early)."""
    return stream_token - (coded * group - pad if coded else 0)


@op(mutates_args=("sink_keys", "sink_values", "tail", "v_codes", "v_scales", "v_mins", "positions", "counts"))
def stream_append(
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    tail: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    group: int,
    pad: int,
    v_format: str,
    search_scale: bool,
    rotation: int,
) -> None:
    """One new token of a layer (`key` after RoPE and `value` `[batch, kv_heads, 1, dim]`, at `position_ids` int
    `[batch, 1]`; None: the count of tokens held) into its slot: while fewer than `sink_keys.shape[2]` tokens are
    held, raw into the sinks (fp16 saturates); else the key turned back by its RoPE (`freqs` float64, `order`; None:
    as given) into the raw `tail` fp16 `[batch, kv_heads, group, dim]` of the open key group (the stream's first
    group starts `pad` slots early), and the value quantized (`v_format`, scale searched with `search_scale`,
    Hadamard-rotated by blocks of `rotation`, 0: not) into its row of the values' storage `[batch, kv_heads,
    capacity, ...]`. `positions` int32 `[batch, max_cache_len]` records the position; `counts[TOKENS]` advances.
    Past the sinks: `kernels.append_token` (one C++ call on the CPU)."""
    from . import append_token

    held, coded = counts.tolist()[:2]
    sinks = sink_keys.shape[2]
    if held < sinks:
        positions[:, held] = held if position_ids is None else position_ids[:, 0]
        to_sinks(key, value, sink_keys, sink_values, held)
        counts[TOKENS] += 1
        return
    values = _values(v_codes, v_scales, v_mins, v_format, value.shape[-1])
    row = _tail_row(held - sinks, coded, group, pad)
    append_token(key, value, position_ids, positions, freqs, order, counts, tail, row, sinks, values, v_format,
                 search_scale, rotation)  # fmt: skip


@fake
def _stream_append(key, value, position_ids, sink_keys, sink_values, tail, v_codes, v_scales, v_mins, positions,
                     freqs, order, counts, *, group, pad, v_format, search_scale, rotation):  # fmt: skip
    return None


@op(mutates_args=("planes", "depths", "low", "step", "energy", "before", "counts"))
def adaptive_attention(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    planes: torch.Tensor,
    depths: torch.Tensor,
    low: torch.Tensor,
    step: torch.Tensor,
    tail: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    energy: torch.Tensor,
    before: torch.Tensor,
    counts: torch.Tensor,
    *,
    pad: int,
    total_bits: int,
    clip_range: bool,
    query_weights: bool,
    v_format: str,
    rotation: int,
    scale: float,
) -> torch.Tensor:
    """Attention of a decoding step's `query` `[batch, heads, n, dim]` (as SDPA is given it: after RoPE, the model's
    channel order; `heads` a multiple of the kv heads, `n` rows of one position) over a layer's tokens, the steps of
    `CompressedLayer` with `AdaptiveChannelCodec` keys and plain values: the query energies added to the running sum
    `energy` (with `query_weights`), the key group the newest token completed coded (depths spending `total_bits` per
    token as the energies summed in `before` weigh the channels; `clip_range`) into its rows of `planes`, `depths`,
    `low`, `step` `[batch, kv_heads, groups, ...]`, then attention over the sinks, the coded groups, the raw tail and
    the values, read from the codes (`kernels.adaptive_step` from the buffers: one C++ call on the CPU; elsewhere
    `kernels.stream_attention` over their layouts), under `mask` bool `[batch, n, max_cache_len]` (None: causal).
    Returns fp32 `[batch, heads, n, value_dim]`."""
    from . import adaptive_step, add_query_energy, code_groups

    state = counts.numpy()  # (the host counters, read and written without an op each)
    held, coded, observed, summed = state.tolist()
    dim = query.shape[-1]
    sinks, kv_heads, value_dim = sink_keys.shape[2], sink_keys.shape[1], sink_values.shape[-1]
    group = planes.shape[-1] * 8
    new_energy = None
    if query_weights and held - 1 >= observed:  # (a position is observed once)
        new_energy = add_query_energy(query, order, kv_heads, energy if observed else None)
    stream = max(held - sinks, 0)
    if stream and (pad + stream) % group == 0 and (pad + stream) // group > coded:  # the group is complete
        first = pad if coded == 0 else 0
        weights = before.unsqueeze(2) / summed if summed else None
        code_groups(tail[:, :, : group - first], first, 1, weights, total_bits, clip_range,
                    (planes, depths, low, step), coded)  # fmt: skip
        coded += 1
    if new_energy is not None:
        energy.copy_(new_energy)
        observed = held
        if observed % group == 0 and observed // group >= coded + (sinks - pad) // group:  # the next group's sum
            before.copy_(new_energy)
            summed = observed
    state[:] = (held, coded, observed, summed)
    if not stream:  # sinks only (a prompt shorter than the sinks)
        return _attend(query, mask, sink_keys, sink_values, None, None, positions, freqs, order, held, scale)
    batch, heads, n, _ = query.shape
    rows = query.unflatten(1, (kv_heads, heads // kv_heads)).flatten(2, 3)  # [batch, kv_heads, group * n, dim]
    values = _values(v_codes, v_scales, v_mins, v_format, value_dim)
    out = adaptive_step(rows, mask, sink_keys, sink_values,
                        (planes, depths, low, step), tail, values, positions, freqs, order, held=held, coded=coded,
                        pad=pad, rotation=rotation, n_queries=n, scale=scale)  # fmt: skip
    if out is not None:
        return out.reshape(batch, heads, n, value_dim)
    tokens = coded * group - pad if coded else 0
    keys = AdaptiveStream(
        planes=planes[:, :, :coded] if coded else None,
        bits=depths[:, :, :coded] if coded else None,
        low=low[:, :, :coded] if coded else None,
        step=step[:, :, :coded] if coded else None,
        tail=tail[:, :, : stream - tokens],
        group=group,
        offset=pad,
        dim=dim,
        length=stream,
    )
    values = _plain_values(v_codes, v_scales, v_mins, v_format, value_dim, stream, rotation)
    return _attend(query, mask, sink_keys, sink_values, keys, values, positions, freqs, order, held, scale)


def _plain_values(codes, scales, mins, fmt: str, dim: int, stream: int, rotation: int) -> PlainStream:
    """The first `stream` tokens of per-token packed values as the attention kernels read them."""
    return PlainStream(_values(codes, scales, mins, fmt, dim).map(lambda t: t[:, :, :stream]), dim, stream, rotation)


def _attend(query, mask, sink_keys, sink_values, keys, values, positions, freqs, order, held: int, scale: float):
    """Attention of a decoding step's `query` `[batch, heads, n, dim]` over the `held` tokens of a layer: its sinks (the
    first `sink_keys.shape[2]`, raw) and the stream after them (`keys`, `values`: layouts, None when every token is a
    sink; keys before RoPE when `freqs` is given, the positions' angles applied as they are read) under `mask` bool
    `[batch, n, max_cache_len]` (None: causal). Returns fp32 `[batch, heads, n, value_dim]`."""
    from . import stream_attention

    batch, heads, n, _ = query.shape
    sinks, value_dim = sink_keys.shape[2], sink_values.shape[-1]
    mask = None if mask is None else mask[:, :, :held]
    if mask is not None and n == 1 and mask.device.type == "cpu" and bool(mask.all()):
        mask = None  # (every token visible: the causal rule is the same, and the kernel reads no mask)
    sink_k, sink_v = sink_keys[:, :, : min(held, sinks)], sink_values[:, :, : min(held, sinks)]
    if keys is None:  # sinks only: the generic path, as the eager layer takes it
        state = OnlineSoftmax(query, scale, None if mask is None else mask[:, None], held)
        state.add(sink_k, sink_v)
        return state.result()
    grouped, sink_k, rope = stored_inputs(query, sink_k, positions, freqs, order, held)
    out = stream_attention(grouped, sink_k, sink_v, keys, values, rope=rope, mask=mask, n_queries=n,
                           causal_offset=held - n, scale=scale)  # fmt: skip
    return out.float().reshape(batch, heads, n, value_dim)


@fake
def _adaptive_attention(query, mask, sink_keys, sink_values, planes, depths, low, step, tail, v_codes, v_scales,
                        v_mins, positions, freqs, order, energy, before, counts, *, pad, total_bits, clip_range,
                        query_weights, v_format, rotation, scale):  # fmt: skip
    return query.new_empty(*query.shape[:3], sink_values.shape[-1], dtype=torch.float32)


def with_kernel(generic, fake_of, arguments: str) -> None:
    """Define `hf_deltakv::<name>_cpu` for the op `generic` (its function; `fake_of`: its fake implementation): its
    schema with `arguments` (keyword-only: the C++ kernel's) after its own. On CPU tensors the kernel of
    `cpu/step_ops.cpp` runs it, once `kernels.append_kernel_arguments` or `attention_kernel_arguments` registered it:
    one C++ call, no Python, handing each step it does not serve (tokens into the sinks) to `generic` with its own
    arguments. Anywhere else (and before the kernel is registered) this runs `generic` itself."""
    name = generic.__name__
    base = getattr(torch.ops.hf_deltakv, name).default
    signature = str(base._schema)
    head, returns = signature[signature.index("(") :].rsplit(") ->", 1)
    own = [argument.split()[-1] for argument in arguments.split(",")]

    def without(kwargs: dict) -> dict:
        return {key: value for key, value in kwargs.items() if key not in own}

    _LIBRARY.define(f"{name}_cpu{head}, {arguments}) ->{returns}", tags=tuple(base.tags))
    _LIBRARY.impl(f"{name}_cpu", lambda *args, **kwargs: generic(*args, **without(kwargs)), "CompositeExplicitAutograd")
    torch.library.register_fake(f"hf_deltakv::{name}_cpu", lambda *args, **kwargs: fake_of(*args, **without(kwargs)),
                                lib=_LIBRARY)  # fmt: skip
    DEFINED.append(f"{name}_cpu")


with_kernel(stream_append, _stream_append, "int v_kind, int v_block, float[] divisors, float rotation_scale, "
            "float rotation_limit")  # fmt: skip
with_kernel(adaptive_attention, _adaptive_attention, "int v_kind, int v_block, int split")


# On GPUs the same step runs with its counters on the device (`state`, int64 `[4]` laid out as `counts`): every
# launch the same at every step and nothing read on the host (`triton/step.py`), so a CUDA graph replays the ops too.


def with_device_counters(generic, fake_of, body) -> None:
    """Define `hf_deltakv::<name>_dev` for the op `generic` (its function; `fake_of`: its fake implementation): its
    schema with the counters `counts` named `state` (a device tensor) and not tagged `cudagraph_unsafe`; `body` runs
    it (the same arguments). A layer takes it where `kernels.device_step_serves`."""
    name = generic.__name__
    signature = str(getattr(torch.ops.hf_deltakv, name).default._schema)
    _LIBRARY.define(f"{name}_dev" + re.sub(r"\bcounts\b", "state", signature[signature.index("(") :]))
    _LIBRARY.impl(f"{name}_dev", body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"hf_deltakv::{name}_dev", fake_of, lib=_LIBRARY)
    DEFINED.append(f"{name}_dev")


def _append_on_device(key, value, position_ids, sink_keys, sink_values, tail, v_codes, v_scales, v_mins, positions,
                      freqs, order, state, *, group, pad, v_format, search_scale, rotation):  # fmt: skip
    """`stream_append` with its counters `state` on the device (`triton/step.py` append_step: 3 launches)."""
    from .triton.step import append_step

    values = _values(v_codes, v_scales, v_mins, v_format, value.shape[-1])
    append_step(key, value, position_ids, sink_keys, sink_values, tail, values, positions, freqs, order, state,
                group=group, pad=pad, fmt=v_format, search_scale=search_scale, rotation=rotation)  # fmt: skip


def _attend_on_device(query, mask, sink_keys, sink_values, planes, depths, low, step, tail, v_codes, v_scales, v_mins,
                      positions, freqs, order, energy, before, state, *, v_format, **options):  # fmt: skip
    """`adaptive_attention` with its counters `state` on the device (`triton/step.py` attention_step: 5 launches)."""
    from .triton.step import attention_step

    values = _values(v_codes, v_scales, v_mins, v_format, sink_values.shape[-1])
    return attention_step(query, mask, sink_keys, sink_values, (planes, depths, low, step), tail, values, positions,
                          freqs, order, energy, before, state, **options)  # fmt: skip


with_device_counters(stream_append, _stream_append, _append_on_device)
with_device_counters(adaptive_attention, _adaptive_attention, _attend_on_device)


@op(mutates_args=("k_codes", "k_scales", "k_mins", "counts"))
def channel_attention(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    k_mins: torch.Tensor | None,
    tail: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    k_format: str,
    v_format: str,
    rotation: int,
    scale: float,
) -> torch.Tensor:
    """`adaptive_attention` for KIVI-style keys (`CompressedLayer` with `ChannelGroupCodec` keys and plain values): the
    key group the newest token completed (the raw `tail` fp16 `[batch, kv_heads, group, dim]`) quantized per channel
    in `k_format` (one block of `group` tokens per channel) into its row of the groups' storage (`k_codes`, `k_scales`,
    `k_mins` `[batch, kv_heads, groups, dim, ...]`), then attention over the sinks, the coded groups, the tail and the
    values, read from the codes. Returns fp32 `[batch, heads, n, value_dim]`."""
    from . import quantize_at

    held, coded = counts.tolist()[:2]
    dim = query.shape[-1]
    sinks, value_dim = sink_keys.shape[2], sink_values.shape[-1]
    groups = _values(k_codes, k_scales, k_mins, k_format, tail.shape[2])
    group = groups.fmt.block_size
    stream = max(held - sinks, 0)
    if stream and stream % group == 0 and stream // group > coded:  # the group is complete: its channels' blocks
        rows = tail.transpose(2, 3).contiguous()  # [batch, kv_heads, dim channels, group tokens]
        quantize_at(rows, k_format, False, groups.map(lambda t: t.flatten(2, 3)), coded * dim)
        coded += 1
        counts[CODED] = coded
    if not stream:
        return _attend(query, mask, sink_keys, sink_values, None, None, positions, freqs, order, held, scale)
    coded_groups = groups.map(lambda t: t[:, :, :coded]) if coded else None
    keys = ChannelStream(coded_groups, tail[:, :, : stream - coded * group], group, dim, stream)
    values = _plain_values(v_codes, v_scales, v_mins, v_format, value_dim, stream, rotation)
    return _attend(query, mask, sink_keys, sink_values, keys, values, positions, freqs, order, held, scale)


@fake
def _channel_attention(query, mask, sink_keys, sink_values, k_codes, k_scales, k_mins, tail, v_codes, v_scales,
                       v_mins, positions, freqs, order, counts, *, k_format, v_format, rotation, scale):  # fmt: skip
    return query.new_empty(*query.shape[:3], sink_values.shape[-1], dtype=torch.float32)


# --- Evicting layers (`layers.static.PackedKeptLayer`: StreamingLLMCache's, SnapKVCache's) ---------------------------
# fp16 slots preallocated (keys, values, each slot's position: `KeptStream`'s buffers), the steps of
# `layers.evicting.EvictingLayer` over them: `kept_append` (the token into the slot after the last, the kept tokens
# compacted first when the room is spent) and `kept_attention_step` (attention over the sinks and the slots, then the
# policy's eviction, the kept tokens compacted when the evicted slots are worth a copy). Their host counters, `counts`
# int64 `[5]`: the tokens seen (sinks included), the slots used, the first slot not evicted by StreamingLLM's counter,
# the tokens kept, and the slots the eager layer's buffers would hold (the room it grows by: the same compactions,
# hence the same slots and bytes, capped at the capacity). SnapKV's evicted slots are marked at once (-1), where the
# eager layer marks them at its next update: nothing reads them in between.


def _compact_in_place(keys, values, index, slots: int, first: int, live: int, room: int) -> int:
    """The kept tokens of slots `first...slots` moved, in order, into the first `live` slots (through a copy of the
    slots used: `kernels.compact_kept`); returns the slots the eager layer's new buffers hold, `live + room`, at most
    the capacity."""
    from . import compact_kept

    held = KeptStream(*(t[:, :, :slots].clone() for t in (keys, values, index)), first, live)
    compact_kept(held, None, KeptStream(keys, values, index, 0, live))
    return min(live + room, keys.shape[2])


@op(mutates_args=("sink_keys", "sink_values", "keys", "values", "index", "counts"))
def kept_append(
    key: torch.Tensor,
    value: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """One new token of an evicting layer (`key`, `value` `[batch, kv_heads, 1, dim]`): while fewer than
    `sink_keys.shape[2]` tokens are seen, raw into the sinks (fp16 saturates); else into the slot after the last of
    `keys`, `values` fp16 and `index` int32 `[batch, kv_heads, capacity, ...]` with its position, the kept tokens
    compacted first when the slots the eager layer would hold are all used (`EvictingLayer._room`)."""
    from . import keep_rows

    seen, slots, first, live, end = counts.tolist()
    sinks = sink_keys.shape[2]
    if seen < sinks:
        to_sinks(key, value, sink_keys, sink_values, seen)
        counts[0] += 1
        return
    if slots + 1 > end:  # the room is spent: the kept tokens compacted, room made (none for the first token)
        room = 1 + (max(ROOM_MIN, (live + 1) // ROOM_FRACTION) if slots else 0)
        end = _compact_in_place(keys, values, index, slots, first, live, room) if slots else min(room, keys.shape[2])
        slots, first = live, 0
    if slots + 1 > keys.shape[2]:
        raise RuntimeError(f"an evicting layer's {keys.shape[2]} slots are all used (a bug: they hold its budget)")
    stream = KeptStream(keys[:, :, :end], values[:, :, :end], index[:, :, :end], first, live)
    keep_rows(key, value, stream, slots, seen)
    counts.copy_(torch.tensor([seen + 1, slots + 1, first, live + 1, end]))


@fake
def _kept_append(key, value, sink_keys, sink_values, keys, values, index, counts):
    return None


@op(mutates_args=("keys", "values", "index", "counts"))
def kept_attention_step(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    counts: torch.Tensor,
    *,
    keep: float,
    recent: int,
    pool: int,
    snapkv: bool,
    scale: float,
) -> torch.Tensor:
    """Attention of a decoding step's `query` `[batch, heads, n, dim]` over an evicting layer's sinks and kept slots
    (`kernels.kept_attention`, a slot's column of `mask` bool `[batch, n, max_cache_len]` its position; None: causal),
    then `EvictingLayer.read_done`: what exceeds `keep` of the tokens seen (at least `recent` kept) evicted, the oldest
    (StreamingLLM) or SnapKV's choice from this step's attention (`snapkv`: pooled over `pool` neighbours, the `recent`
    newest never), the kept tokens compacted when the evicted slots are worth a copy. Returns fp32 `[batch, heads, n,
    value_dim]`."""
    from . import kept_attention, snapkv_evicted

    seen, slots, first, live, end = counts.tolist()
    n = query.shape[2]
    sinks = sink_keys.shape[2]
    if not slots:  # every token is a sink
        return _attend(query, mask, sink_keys, sink_values, None, None, None, None, None, seen, scale)
    mask = None if mask is None else mask[:, None, :, :seen]
    stream = KeptStream(keys[:, :, :slots], values[:, :, :slots], index[:, :, :slots], first, live)
    observe_from = max(n - recent, 0) if snapkv else None
    out, observed = kept_attention(query, sink_keys, sink_values, stream, mask, scale, seen - n, observe_from)
    budget = max(math.ceil(keep * seen) - sinks, recent)
    drop = live - budget
    if drop > 0:
        if not snapkv:  # the oldest: the first slots
            first += drop
        else:
            if observed is None:  # (no attention observed: the oldest)
                observed = torch.zeros(stream.index.shape, dtype=torch.float32, device=keys.device)
            index.scatter_(2, snapkv_evicted(stream, observed, drop, min(recent, budget), pool), -1)
        live -= drop
        if slots - live > max(ROOM_MIN, live // ROOM_FRACTION):  # evicted slots worth a copy
            end = _compact_in_place(keys, values, index, slots, first, live, max(ROOM_MIN, live // ROOM_FRACTION))
            slots, first = live, 0
    counts.copy_(torch.tensor([seen, slots, first, live, end]))
    return out.float()


@fake
def _kept_attention_step(query, mask, sink_keys, sink_values, keys, values, index, counts, *, keep, recent, pool,
                         snapkv, scale):  # fmt: skip
    return query.new_empty(*query.shape[:3], sink_values.shape[-1], dtype=torch.float32)


# --- Token-delta keys (`layers.static.PackedTokenLayer`: DeltaKVCache with keys="token") ---------------------------
# Keyframes, deltas and mean snapshots in storage preallocated for the stream, whose rows follow from the stream's
# length (`DeltaRows.counts`): `counts` int64 `[1]`, the tokens held. The closed loop's state (`reference`, the last
# reconstruction, and `running`, the inputs' sum: fp32 `[batch, kv_heads, 1, dim]`) is written in place.


def _delta_storage(kf_codes, kf_scales, kf_mins, d_codes, d_scales, d_mins, keyframe_format: str, delta_format: str,
                   dim: int) -> tuple[QuantizedTensor, QuantizedTensor]:  # fmt: skip
    return _values(kf_codes, kf_scales, kf_mins, keyframe_format, dim), _values(d_codes, d_scales, d_mins,
                                                                               delta_format, dim)  # fmt: skip


_TOKEN_WRITES = ("sink_keys", "sink_values", "kf_codes", "kf_scales", "kf_mins", "d_codes", "d_scales", "d_mins",
                 "means", "reference", "running", "v_codes", "v_scales", "v_mins", "positions", "counts")  # fmt: skip


@op(mutates_args=_TOKEN_WRITES)
def token_append(
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    kf_codes: torch.Tensor,
    kf_scales: torch.Tensor | None,
    kf_mins: torch.Tensor | None,
    d_codes: torch.Tensor,
    d_scales: torch.Tensor | None,
    d_mins: torch.Tensor | None,
    means: torch.Tensor,
    reference: torch.Tensor,
    running: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    kf: int,
    keyframe_format: str,
    delta_format: str,
    previous: bool,
    intra: bool,
    mean_reference: bool,
    key_rotation: int,
    v_format: str,
    search_scale: bool,
    rotation: int,
) -> None:
    """One new token of a layer whose keys are token deltas (`codecs.delta.DeltaCodec._append_steps`): into the sinks
    while fewer than `sink_keys.shape[2]` tokens are held (as `stream_append`); else the key (RoPE undone by `freqs`,
    `order` at its position; rotated by blocks of `key_rotation`) coded as a keyframe every `kf` tokens
    (`keyframe_format`) or a closed-loop delta (`delta_format`, from the previous reconstruction with `previous`, else
    the keyframe's; `intra`: a block may be coded against the newest mean snapshot) into its row, a mean snapshot
    written when due (`mean_reference`), `reference` and `running` updated (`kernels.delta_tokens`); the value coded
    as `stream_append` codes it."""
    from . import delta_tokens, quantize_at

    held = counts.tolist()[0]
    sinks = sink_keys.shape[2]
    positions[:, held] = held if position_ids is None else position_ids[:, 0]
    if held < sinks:
        to_sinks(key, value, sink_keys, sink_values, held)
    else:
        stream = held - sinks
        keyframes, deltas = _delta_storage(kf_codes, kf_scales, kf_mins, d_codes, d_scales, d_mins, keyframe_format,
                                           delta_format, key.shape[-1])  # fmt: skip
        key_at, delta_at, mean_at = DeltaRows.counts(0, stream, kf, SNAPSHOTS, mean_reference)
        is_delta, due = DeltaRows.counts(stream, 1, kf, SNAPSHOTS, mean_reference)[1:]
        rows = DeltaRows(keyframes, key_at, deltas if is_delta else None, delta_at, means if due else None, mean_at,
                         stream, kf, previous, intra, SNAPSHOTS)  # fmt: skip
        long_term = means[:, :, mean_at - 1] if intra and mean_reference and mean_at else None
        turn = (positions[:, held : held + 1], freqs, order) if freqs is not None else None
        state, total = delta_tokens(key, turn, key_rotation, reference, running if mean_reference and stream else None,
                                    long_term, rows)  # fmt: skip
        reference.copy_(state)
        if mean_reference:
            running.copy_(total)
        values = _values(v_codes, v_scales, v_mins, v_format, value.shape[-1])
        quantize_at(value, v_format, search_scale, values, stream, rotation)
    counts[TOKENS] += 1


@fake
def _token_append(key, value, position_ids, sink_keys, sink_values, kf_codes, kf_scales, kf_mins, d_codes, d_scales,
                  d_mins, means, reference, running, v_codes, v_scales, v_mins, positions, freqs, order, counts, *, kf,
                  keyframe_format, delta_format, previous, intra, mean_reference, key_rotation, v_format,
                  search_scale, rotation):  # fmt: skip
    return None


@op()
def token_attention(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    kf_codes: torch.Tensor,
    kf_scales: torch.Tensor | None,
    kf_mins: torch.Tensor | None,
    d_codes: torch.Tensor,
    d_scales: torch.Tensor | None,
    d_mins: torch.Tensor | None,
    means: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    kf: int,
    keyframe_format: str,
    delta_format: str,
    previous: bool,
    intra: bool,
    mean_reference: bool,
    key_rotation: int,
    v_format: str,
    rotation: int,
    scale: float,
) -> torch.Tensor:
    """Attention of a decoding step's `query` over a layer whose keys are token deltas (`token_append`'s storage, its
    arguments): the sinks, then the stream read from the codes (`kernels.DeltaStream`, `kernels.stream_attention`).
    Returns fp32 `[batch, heads, n, value_dim]`."""

    held, dim = counts.tolist()[0], query.shape[-1]
    stream = max(held - sink_keys.shape[2], 0)
    if not stream:
        return _attend(query, mask, sink_keys, sink_values, None, None, positions, freqs, order, held, scale)
    keyframes, deltas = _delta_storage(kf_codes, kf_scales, kf_mins, d_codes, d_scales, d_mins, keyframe_format,
                                       delta_format, dim)  # fmt: skip
    key_rows, delta_rows, snapshots = DeltaRows.counts(0, stream, kf, SNAPSHOTS, mean_reference)
    keys = DeltaStream(
        keyframes=keyframes.map(lambda t: t[:, :, :key_rows]),
        deltas=deltas.map(lambda t: t[:, :, :delta_rows]) if delta_rows else None,
        means=means[:, :, :snapshots] if snapshots else None,
        kf=kf,
        reference="previous" if previous else "keyframe",
        intra=intra,
        dim=dim,
        length=stream,
        rotation=key_rotation,
    )
    values = _plain_values(v_codes, v_scales, v_mins, v_format, sink_values.shape[-1], stream, rotation)
    return _attend(query, mask, sink_keys, sink_values, keys, values, positions, freqs, order, held, scale)


@fake
def _token_attention(query, mask, sink_keys, sink_values, kf_codes, kf_scales, kf_mins, d_codes, d_scales, d_mins,
                     means, v_codes, v_scales, v_mins, positions, freqs, order, counts, *, kf, keyframe_format,
                     delta_format, previous, intra, mean_reference, key_rotation, v_format, rotation,
                     scale):  # fmt: skip
    return query.new_empty(*query.shape[:3], sink_values.shape[-1], dtype=torch.float32)
