"""Compute ops: PyTorch references (the specification), C++ kernels for the CPU, Triton kernels for GPUs.

This is the one dispatch point. On the CPU, ops with a compiled kernel use it (`cpu/`, built on first use); on
CUDA (NVIDIA, and AMD through ROCm builds of PyTorch, which also report `cuda` devices) Triton kernels run when
Triton is installed; everything else runs the reference (`reference.py`). `HF_DELTAKV_KERNELS` chooses otherwise
(`KERNEL_CHOICES`): `reference` forces the reference everywhere, `triton` takes the branch a CUDA device takes on any
device (Triton where a kernel exists, else the reference, never C++; CPU tensors need `TRITON_INTERPRET=1`), so the
GPU path runs and is counted without a GPU. Ops take plain tensors and the stream descriptions of `layout.py`, never
codec objects.

The table (op: CPU kernel | GPU kernel; "-": the reference runs there; each kernel tested against `reference.py`):

    quantize           cpu/encode.cpp (q3_0 too)   | triton/quantize.py (append.py's kernel, a block a row)
    quantize_at        cpu/encode.cpp (rotated too)| triton/append.py (every format: rotate + search + pack)
    undo_rope_into     cpu undo_rope + a copy      | triton/append.py
    append_token       cpu/encode.cpp (one call)   | undo_rope_into + quantize_at above (a decoding step's token)
    add_query_energy   cpu query_energy + an add   | triton/append.py
    add_query_energies cpu query_energy + adds     | triton/append.py (a chunk's running sums, one launch)
    query_energy       cpu                         | -
    allocate_depths    cpu                         | - (inside code_groups on GPUs)
    pack_planes        cpu                         | - (inside code_groups on GPUs)
    clipped_codes      cpu                         | - (inside code_groups on GPUs)
    best_candidate     cpu (clipped_codes' search) | -
    grid_ranges        cpu/encode.cpp              | - (the grid's fp16 ranges, derived at every read)
    code_groups        the three above             | triton/adaptive_code.py (a group's whole coding, one launch)
                       (grid ranges: key_grid's    |   (grid ranges: key_grid's candidates and the reference's
                       candidates, best_candidate) |   search, PyTorch ops)
    copy_rows          -                           | triton/copy.py (grown storage, 8 copies a launch)
    decode_stream      cpu (adaptive groups)       | -
    decode_into        cpu/stream_attention.cpp    | triton/reconstruct.py (adaptive keys, plain values)
    code_delta         cpu/encode.cpp              | -
    delta_encode_groups -                          | triton/delta_encode.py
    delta_tokens       cpu undo_rope + code_delta  | triton/delta_encode.py (a decoding step's tokens, one launch)
    stream_attention   cpu/stream_attention.cpp    | triton/adaptive_attention.py (adaptive keys + plain values),
                       (plain, delta streams)      |   decode_attention.py (plain keys + plain values: split, then
                                                   |   the adaptive merge), delta_attention.py (delta keys)
    adaptive_step      cpu/stream_attention.cpp    | - (None: the caller's stream_attention; a step over storage)
    append_kernel_arguments cpu/step_ops.cpp       | - (None: ops.stream_append's Python body)
    attention_kernel_arguments cpu/step_ops.cpp    | - (None: ops.adaptive_attention's Python body)
    device_step_serves -                           | triton/step.py (ops.*_dev: counters on the device, constant
                                                   |   launches; False: the host-counter ops)
    keep_rows          -                           | triton/kept.py (the evicting caches' new tokens, one launch)
    compact_kept       -                           | triton/kept.py (the kept tokens into new storage, one launch)
    kept_attention     -                           | triton/kept.py (one query per head: split over the slots, merge)
    snapkv_evicted     -                           | triton/kept.py (from the attention kernel's observation)
    latent ops         cpu/latent.cpp              | triton/latent.py (dequantize only)
    write_raw          -                           | triton/residual.py (the residual cache's raw window, one launch)
    encode_latent_into cpu undo_rope + quantize_latent | triton/residual.py (RoPE undone, encoded, quantized, packed)
    latent_stream_attention -                      | triton/residual.py (one query per head: split, merge)
    sparse_matvec      cpu/sparse_matvec.cpp       | triton/sparse_matvec.py

Compiled decoding calls ops registered with `torch.library` (`ops.py`: tensors and scalars in, a fake
implementation each): `hf_deltakv::plain_attention` runs `stream_attention` above over plain streams;
`hf_deltakv::stream_append` (`undo_rope_into`, `quantize_at`) with `hf_deltakv::adaptive_attention`
(`add_query_energy`, `code_groups`, `stream_attention`) is a decoding step of a `DeltaKVCache` layer (on the CPU their
`_cpu` forms: the C++ kernels of `cpu/step_ops.cpp` registered for the ops, whose arguments the two
`*_kernel_arguments` above give, handing the steps they do not serve to the Python bodies; on GPUs their `_dev`
forms, the counters on the device, where `device_step_serves`), with
`hf_deltakv::channel_attention` (`quantize_at`, `stream_attention`) one of a `KIVIKVCache` layer, over storage
preallocated for `max_cache_len` tokens; `residual.ops` registers the residual cache's two (`latent_append`:
`write_raw`, `encode_latent_into`; `latent_attention_step`: `latent_stream_attention`, or `dequantize_latent` and
`latent_attention` by chunks) in the same library.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from ..quant import Kind, QuantizedTensor, get_format, unpack_4bit
from ..quant.bitpack import GROUP
from . import key_grid, reference
from .cpu.stream_attention import HEAD_DIMS as CPU_HEAD_DIMS
from .hadamard import rotate
from .layout import (
    AdaptiveStream,
    BasisStream,
    ChannelStream,
    DeltaRows,
    DeltaStream,
    KeptStream,
    LatentCoder,
    LatentStream,
    Observation,
    PlainStream,
    RopeAngles,
    SnapshotSchedule,
    StreamKind,
    StreamLayout,
)

__all__ = [
    "AdaptiveStream",
    "BasisStream",
    "ChannelStream",
    "DeltaRows",
    "DeltaStream",
    "KeptStream",
    "LatentCoder",
    "LatentStream",
    "Observation",
    "PlainStream",
    "RopeAngles",
    "SnapshotSchedule",
    "StreamKind",
    "StreamLayout",
    "adaptive_step",
    "add_query_energies",
    "add_query_energy",
    "allocate_depths",
    "append_kernel_arguments",
    "append_token",
    "attention_kernel_arguments",
    "code_delta",
    "code_groups",
    "compact_kept",
    "copy_rows",
    "decode_stream",
    "delta_encode_groups",
    "delta_tokens",
    "dequantize_latent",
    "encode_latent_into",
    "keep_rows",
    "kept_attention",
    "latent_attention",
    "latent_stream_attention",
    "pack_planes",
    "quantize",
    "quantize_at",
    "quantize_latent",
    "query_energy",
    "reference",
    "snapkv_evicted",
    "sparse_matvec",
    "sparse_matvec_kernel",
    "stream_attention",
    "triton_available",
    "undo_rope",
    "undo_rope_into",
    "use_triton",
    "write_raw",
]


@functools.cache
def triton_available() -> bool:
    """Triton is importable (looked up once: the dispatch runs on every decode step)."""
    return importlib.util.find_spec("triton") is not None


# Values of HF_DELTAKV_KERNELS: "auto" (the default) runs kernels where they run, building the CPU ones on first use;
# "prebuilt" uses the CPU kernels only if they are already built (never waits for a build); "reference" runs the
# PyTorch references everywhere; "triton" runs every op as on a CUDA device (the GPU path), on any device.
KERNEL_CHOICES = ("auto", "prebuilt", "reference", "triton")


def kernel_choice() -> str:
    """`HF_DELTAKV_KERNELS` (see `KERNEL_CHOICES`; "auto" inside `prebuilt_only()` reads "prebuilt"); any value but
    those allowed is refused."""
    choice = os.environ.get("HF_DELTAKV_KERNELS", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"HF_DELTAKV_KERNELS must be one of {KERNEL_CHOICES}, got {choice!r}")
    return "prebuilt" if choice == "auto" and _PREBUILT_ONLY else choice


_PREBUILT_ONLY: list[bool] = []  # a stack of `prebuilt_only()` scopes


@contextlib.contextmanager
def prebuilt_only():
    """Within: the CPU kernels are used if already built, never built (for work whose results do not depend on them,
    such as one forward per window; an explicit `HF_DELTAKV_KERNELS` still rules)."""
    _PREBUILT_ONLY.append(True)
    try:
        yield
    finally:
        _PREBUILT_ONLY.pop()


def forced_reference() -> bool:
    """`HF_DELTAKV_KERNELS=reference`: every op runs its PyTorch reference."""
    return kernel_choice() == "reference"


def use_triton(device: torch.device | str) -> bool:
    """Whether ops on `device` run as Triton kernels (see module docstring)."""
    choice = kernel_choice()
    if choice == "triton":
        _check_forced_triton(torch.device(device))
        return True
    return choice != "reference" and torch.device(device).type == "cuda" and triton_available()


def _check_forced_triton(device: torch.device) -> None:
    """`HF_DELTAKV_KERNELS=triton` needs Triton, and on anything but a GPU its interpreter (chosen when a kernel is
    defined, so set before Triton is imported)."""
    if not triton_available():
        raise ImportError("HF_DELTAKV_KERNELS=triton needs Triton: pip install 'hf-deltakv[triton]'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            f"HF_DELTAKV_KERNELS=triton on {device.type} tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before Triton is imported"
        )


def _cpu_extension(device: torch.device):
    """The compiled CPU kernels when `device` is the CPU and they are built (or can be), else None."""
    choice = kernel_choice()
    if device.type != "cpu" or choice in ("reference", "triton"):
        return None
    from .cpu import extension, prebuilt

    return prebuilt() if choice == "prebuilt" else extension()


ENCODED_KINDS = (Kind.Q4_SYM, Kind.Q4_ASYM, Kind.Q8)  # what triton/quantize.py and the delta codec's kernels code
CPU_QUANTIZED_KINDS = (*ENCODED_KINDS, Kind.Q3_SYM)  # what cpu/encode.cpp quantizes


def _encodes(fmt: str, dim: int, kinds: tuple = ENCODED_KINDS) -> bool:
    """Formats of `kinds` (llama.cpp's block arithmetic by default: not f16, not q3_0), with blocks tiling `dim`."""
    return get_format(fmt).kind in kinds and dim % get_format(fmt).block_size == 0


def quantize(x: torch.Tensor, fmt: str, search_scale: bool = False) -> QuantizedTensor:
    """`reference.quantize` (block formats), dispatched: the C++ kernel on the CPU, the Triton kernel on GPUs (q3_0
    and searched scales too on both), the reference otherwise; the same bytes on every path (tested)."""
    if not _encodes(fmt, x.shape[-1], CPU_QUANTIZED_KINDS):
        return reference.quantize(x, fmt, search_scale)
    if use_triton(x.device):
        from .triton.quantize import quantize as kernel

        return kernel(x, fmt, search_scale)
    compiled = _cpu_extension(x.device)
    if compiled is not None:
        from .cpu.encode import quantize as kernel

        return kernel(x, fmt, compiled, search_scale)
    return reference.quantize(x, fmt, search_scale)


def quantize_at(
    x: torch.Tensor, fmt: str, search_scale: bool, target: QuantizedTensor, at: int, rotation: int = 0
) -> None:
    """`reference.quantize_at` (new tokens, rotated first when `rotation`, quantized into growing storage, in place),
    dispatched: the Triton kernel on GPUs (every format: rotation, search and packing in one launch), the C++ kernel
    on the CPU (the same, threads over the rows); anything else rotates, quantizes by `quantize` and copies the rows
    in. The bytes of `quantize` on every path (tested)."""
    if use_triton(x.device):
        from .triton.append import quantize_at as kernel
        from .triton.append import serves_quantize

        if serves_quantize(fmt, x.shape[-1]) and _rows_contiguous(target):
            return kernel(x, fmt, search_scale, target, at, rotation)
    served = _encodes(fmt, x.shape[-1], CPU_QUANTIZED_KINDS) and _rows_contiguous(target)
    compiled = _cpu_extension(x.device) if served else None
    if compiled is None:  # the dispatched `quantize` (Triton on GPUs), then a copy
        rows = rotate(x) if rotation else x.float()
        return reference.write_rows(target, quantize(rows, fmt, search_scale), at)
    from .cpu.encode import quantize_at as kernel

    kernel(x.float(), fmt, search_scale, target, at, rotation, compiled)


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
) -> None:
    """`reference.append_token` (a decoding step's token into a preallocated `DeltaKVCache` layer), dispatched: one
    C++ call on the CPU (`cpu/encode.cpp` append_step: the formats `quantize_at`'s kernel codes); elsewhere the
    reference's steps through the dispatched `undo_rope_into` and `quantize_at` (a Triton launch each on GPUs). The
    same bytes (tested)."""
    served = _encodes(fmt, value.shape[-1], CPU_QUANTIZED_KINDS) and _rows_contiguous(values)
    compiled = _cpu_extension(value.device) if served and key.shape[-1] % 2 == 0 else None
    if compiled is None:
        return reference.append_token(key, value, position_ids, positions, freqs, order, counts, tail, row, sinks,
                                      values, fmt, search_scale, rotation, undo_rope_into, quantize_at)  # fmt: skip
    from .cpu.encode import append_token as kernel

    kernel(key, value, position_ids, positions, freqs, order, counts, tail, row, sinks, values, fmt, search_scale,
           rotation, compiled)  # fmt: skip


def adaptive_step(
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
    *,
    held: int,
    coded: int,
    pad: int,
    rotation: int,
    n_queries: int,
    scale: float,
) -> torch.Tensor | None:
    """A decoding step's attention over a preallocated `DeltaKVCache` layer past its sinks, read from its buffers
    whole (`groups`: planes, depths, low, step, `coded` of them coded; `tail`; `values`; `held` tokens, `pad` slots
    before the stream in group 0) in one C++ call on the CPU (`cpu/stream_attention.cpp` adaptive_step: the layouts
    built from the buffers, not from Python objects): `stream_attention` over the `AdaptiveStream` and `PlainStream`
    of those tokens, the same floats (tested). `query` `[batch, kv_heads, rows, dim]` (rows: the query heads of a kv
    head times `n_queries` positions), `mask` bool `[batch, n_queries, max_cache_len]` (rows contiguous; None:
    causal). Returns fp32 `[batch, kv_heads, rows, dim]`, or None where the kernel does not serve (another device, head
    dimension or format; `HF_DELTAKV_KERNELS`): the caller then reads the layouts through `stream_attention`."""
    dim = query.shape[-1]
    if dim not in CPU_HEAD_DIMS or sink_values.shape[-1] != dim or dim % values.fmt.block_size:
        return None
    compiled = _cpu_extension(query.device)
    if compiled is None or (mask is not None and mask.stride(-1) != 1):
        return None
    from .cpu.stream_attention import adaptive_step as kernel

    options = dict(held=held, coded=coded, pad=pad, rotation=rotation, n_queries=n_queries, scale=scale)
    return kernel(query, mask, sink_keys, sink_values, groups, tail, values, positions, freqs, order, **options,
                  extension=compiled)  # fmt: skip


def append_kernel_arguments(device: torch.device, fmt: str, search_scale: bool, rotation: int, key_dim: int,
                            values: QuantizedTensor) -> dict | None:  # fmt: skip
    """The C++ kernel's arguments of `ops.stream_append_cpu` (a decoding step's token into a preallocated layer whose
    values are `values`, in `fmt` with `search_scale`, Hadamard-rotated by blocks of `rotation` or not: 0), its kernel
    (`cpu/step_ops.cpp`) registered; None where it does not serve (another device, format or layout;
    `HF_DELTAKV_KERNELS`): the layer then calls `ops.stream_append`. Asked once, when the storage is made."""
    served = _encodes(fmt, values.dim, CPU_QUANTIZED_KINDS) and _rows_contiguous(values) and key_dim % 2 == 0
    compiled = _cpu_extension(device) if served else None
    if compiled is None:
        return None
    from .cpu.encode import divisors
    from .hadamard import ROTATION_LIMIT, rotation_scale

    _register_step_ops(compiled)
    return dict(v_kind=int(get_format(fmt).kind), v_block=get_format(fmt).block_size,
                divisors=divisors(fmt, search_scale), rotation_scale=rotation_scale(rotation) if rotation else 1.0,
                rotation_limit=ROTATION_LIMIT)  # fmt: skip


def attention_kernel_arguments(device: torch.device, fmt: str, dim: int, value_dim: int, group: int) -> dict | None:
    """The C++ kernel's arguments of `ops.adaptive_attention_cpu` (a decoding step's attention over a preallocated
    `DeltaKVCache` layer: head dimension `dim`, values of `value_dim` in `fmt`, key groups of `group` tokens), its
    kernel (`cpu/step_ops.cpp`: the bookkeeping, a completed group's coding as `code_groups` codes it, `adaptive_step`)
    registered; None where `adaptive_step` does not serve: the layer then calls `ops.adaptive_attention`. Asked once,
    when the storage is made."""
    if dim not in CPU_HEAD_DIMS or value_dim != dim or dim % get_format(fmt).block_size:
        return None
    compiled = _cpu_extension(device)
    if compiled is None:
        return None
    from .cpu.stream_attention import TOKENS_PER_ITEM

    _register_step_ops(compiled)
    return dict(v_kind=int(get_format(fmt).kind), v_block=get_format(fmt).block_size,
                split=-(-TOKENS_PER_ITEM // group) * group)  # fmt: skip


def device_step_serves(device: torch.device, fmt: str, dim: int, value_dim: int, group: int) -> bool:
    """Whether a decoding step of a preallocated `DeltaKVCache` layer (head dimension `dim`, values of `value_dim` in
    `fmt`, key groups of `group` tokens) runs as `ops.stream_append_dev` and `ops.adaptive_attention_dev` (the
    counters on the device, `triton/step.py`): where Triton runs (`use_triton`) and its kernels read these shapes.
    Asked once, when the storage is made."""
    if not use_triton(device) or value_dim != dim or dim < 16 or dim & (dim - 1):
        return False
    from .triton.adaptive_attention import TILE_KINDS, WORDS
    from .triton.append import serves_quantize

    form = get_format(fmt)
    return form.kind in TILE_KINDS and dim % form.block_size == 0 and group in WORDS and serves_quantize(fmt, dim)


_STEP_OPS_REGISTERED: list = []  # the extension whose step kernels serve the `_cpu` ops (one per process)


def _register_step_ops(compiled) -> None:
    if not _STEP_OPS_REGISTERED:
        from ..quant.bitplanes import MAX_BITS
        from . import ops  # noqa: F401  (the ops' schemas, defined before their kernels)

        compiled.register_step_ops(reference.CLIPS, MAX_BITS, reference.WATER_LEVEL_STEPS)  # (code_groups' constants)
        _STEP_OPS_REGISTERED.append(compiled)


def _rows_contiguous(target: QuantizedTensor) -> bool:
    """Each stored row of `target` (past the sequence dimension) contiguous, as the append kernels write them."""
    return all(t.stride(-1) == 1 and (t.dim() < 5 or t.stride(-2) == t.shape[-1]) for t in target.tensors())


def undo_rope_into(
    keys: torch.Tensor,
    positions: torch.Tensor | None,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    target: torch.Tensor,
    at: int,
) -> None:
    """`reference.undo_rope_into` (new keys turned back by their RoPE into fp16 storage with room), dispatched: one
    Triton launch on GPUs; elsewhere `undo_rope` (C++ on the CPU) and a copy. The same floats (tested)."""
    dim = keys.shape[-1]
    if use_triton(keys.device) and dim >= 2 and not dim & (dim - 1) and target.stride(-1) == 1:
        from .triton.append import undo_rope_into as kernel

        return kernel(keys, positions, freqs, order, target, at)
    reference.undo_rope_into(keys, positions, freqs, order, target, at, undo_rope)


def copy_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`reference.copy_rows` (grown storage: each buffer's stored rows copied into its new one), dispatched: one
    Triton launch for up to eight copies on GPUs, a copy each elsewhere."""
    if pairs and use_triton(pairs[0][0].device):
        from .triton.copy import copy_rows as kernel

        pairs = kernel(pairs)
    reference.copy_rows(pairs)


def undo_rope(
    keys: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, order: torch.Tensor | None
) -> torch.Tensor:
    """`reference.undo_rope` (keys turned back to before RoPE), dispatched: fp32 keys on the CPU by the C++ kernel (the
    same single-precision operations), anything else by the reference."""
    compiled = _cpu_extension(keys.device) if keys.dtype == torch.float32 else None
    if compiled is None:
        return reference.undo_rope(keys, positions, freqs, order)
    empty = keys.new_empty(0, dtype=torch.long)
    return compiled.undo_rope(keys, positions, freqs.to(torch.float64), empty if order is None else order)


def query_energy(query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, one_position: bool) -> torch.Tensor:
    """`reference.query_energy` (the queries' channel energies the adaptive keys place bits by), dispatched: the C++
    kernel on the CPU (the same fp32 operations in the same order, tested), the reference otherwise."""
    compiled = _cpu_extension(query.device)
    if compiled is None:
        return reference.query_energy(query, order, kv_heads, one_position)
    batch, heads, rows, dim = query.shape
    groups = heads // kv_heads * (rows if one_position else 1)  # rows averaged into each output row
    grouped = query.float().reshape(batch, kv_heads, groups, 1 if one_position else rows, dim).contiguous()
    empty = query.new_empty(0, dtype=torch.long)
    return compiled.query_energy(grouped, empty if order is None else order)


def add_query_energy(
    query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, total: torch.Tensor | None
) -> torch.Tensor:
    """`reference.add_query_energy` (one position's query energies added to the encoder's running sum, a new
    tensor), dispatched: one Triton launch on GPUs, `query_energy` (C++ on the CPU) and an add elsewhere. The same
    floats (tested)."""
    dim = query.shape[-1]
    if use_triton(query.device) and dim >= 2 and not dim & (dim - 1):
        from .triton.append import add_query_energy as kernel

        return kernel(query, order, kv_heads, total if total is None else total.contiguous())
    return reference.add_query_energy(query, order, kv_heads, total, query_energy)


def add_query_energies(
    query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, total: torch.Tensor | None, first: int, group: int
) -> torch.Tensor:
    """`reference.add_query_energies` (a chunk's running sums of query energies before the group starts it crosses and
    at its end), dispatched: one Triton launch on GPUs, `query_energy` (C++ on the CPU) and the adds elsewhere. The
    same floats (tested)."""
    dim = query.shape[-1]
    if use_triton(query.device) and dim >= 2 and not dim & (dim - 1):
        from .triton.append import add_query_energies as kernel

        return kernel(query, order, kv_heads, total if total is None else total.contiguous(), first, group)
    return reference.add_query_energies(query, order, kv_heads, total, first, group, query_energy)


def allocate_depths(level: torch.Tensor, total: int, most: int) -> torch.Tensor:
    """`reference.allocate_depths` (the adaptive keys' bit allocation), dispatched: the C++ kernel on the CPU (the same
    steps, exact sums, the same depths; tested), the reference otherwise."""
    compiled = _cpu_extension(level.device) if level.dtype == torch.float32 else None
    if compiled is None:
        return reference.allocate_depths(level, total, most)
    flat = compiled.allocate_depths(level.reshape(-1, level.shape[-1]).contiguous(), total, most,
                                    reference.WATER_LEVEL_STEPS)  # fmt: skip
    return flat.view(level.shape)


def decode_stream(stream: StreamLayout, start: int, end: int) -> torch.Tensor:
    """`reference.decode_stream`, dispatched: adaptive groups are decoded by the C++ kernel on the CPU."""
    compiled = _cpu_extension(stream.tail.device) if isinstance(stream, AdaptiveStream) else None
    if compiled is None:
        return reference.decode_stream(stream, start, end)
    reference.check_range(start, end, stream.length)

    def groups(planes, bits, low, step):
        lead = planes.shape[:-2]
        flat = compiled.decode_planes(*(t.flatten(0, 2) for t in (planes, bits, low, step)))
        return flat.view(*lead, *flat.shape[1:])

    return reference.decode_adaptive(stream, start, end, groups)


def decode_into(
    stream: StreamLayout, out: torch.Tensor, rope: RopeAngles | None = None, order: torch.Tensor | None = None
) -> None:
    """`reference.decode_into` (a stream decoded into the history a prefill's attention reads, in its dtype),
    dispatched: one Triton launch for adaptive keys or plain values on GPUs (no full-precision copy); on the CPU the
    C++ kernel for every stream the attention kernel reads (one pass, threads over heads and token ranges); elsewhere
    the reference, chunk by chunk through the dispatched `decode_stream`."""
    if use_triton(out.device):
        from .triton.reconstruct import decode_into as kernel
        from .triton.reconstruct import serves

        if serves(stream, out):
            return kernel(stream, out, rope, order)
    compiled = _cpu_extension(out.device)
    if compiled is not None:
        from .cpu.stream_attention import decode_into as kernel
        from .cpu.stream_attention import decodes

        if decodes(stream, out):
            return kernel(stream, out, _rope_arguments(rope, out.new_empty(0)), order, compiled)
    reference.decode_into(stream, out, rope, order, decode=decode_stream)


def pack_planes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`quant.bitplanes.pack_planes`, dispatched: the C++ kernel on the CPU (the same bytes, tested)."""
    compiled = _cpu_extension(codes.device)
    if compiled is None:
        from ..quant.bitplanes import pack_planes as reference_pack

        return reference_pack(codes, bits)
    lead, (group, dim) = codes.shape[:-2], codes.shape[-2:]
    total = int(bits.reshape(-1, dim)[0].long().sum()) if bits.numel() else 0
    flat = compiled.pack_planes(codes.reshape(-1, group, dim), bits.reshape(-1, dim), total)
    return flat.view(*lead, total, group // 8)


def clipped_codes(
    x: torch.Tensor, low: torch.Tensor, span: torch.Tensor, levels: torch.Tensor, clips: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.clipped_codes` (each channel's clipped range and its codes), dispatched: the C++ kernel on the CPU
    (one pass, the candidates' errors in registers and a few kilobytes; the same bytes but where two candidates'
    errors tie to the last bit, tested), the reference otherwise."""
    compiled = _cpu_extension(x.device) if x.dtype == torch.float32 else None
    if compiled is None:
        return reference.clipped_codes(x, low, span, levels, clips)
    lead, (group, dim) = x.shape[:-2], x.shape[-2:]
    flat = (t.reshape(-1, dim) for t in (low, span, levels))
    codes, low, step = compiled.clipped_codes(x.reshape(-1, group, dim), *flat, clips)
    return codes.view(*lead, group, dim), low.view(*lead, dim), step.view(*lead, dim)


def best_candidate(
    x: torch.Tensor, lows: torch.Tensor, steps: torch.Tensor, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.best_candidate` (of given candidate ranges, each channel's of least squared error, and the codes),
    dispatched: the C++ search of `clipped_codes` on the CPU (the same bytes but where two candidates' errors tie to
    the last bit, tested), the reference otherwise."""
    compiled = _cpu_extension(x.device) if x.dtype == torch.float32 else None
    if compiled is None:
        return reference.best_candidate(x, lows, steps, levels)
    lead, (group, dim) = x.shape[:-2], x.shape[-2:]
    count = lows.shape[-1]
    flat = (t.reshape(-1, dim, count) for t in (lows, steps))
    codes, low, step, best = compiled.best_candidate(x.reshape(-1, group, dim), *flat, levels.reshape(-1, dim))
    return codes.view(*lead, group, dim), low.view(*lead, dim), step.view(*lead, dim), best.view(*lead, dim, 1)


def grid_ranges(
    low_code: torch.Tensor, high_code: torch.Tensor, depths: torch.Tensor, origin: torch.Tensor, unit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`key_grid.ranges` of grid-coded groups (codes uint8 `[B, H, G, D]`, packed depths `[B, H, G, D / 2]`, the grid
    fp32 `[B, H, D]`): the fp16 low and step every kernel reads, dispatched: one C++ call on the CPU (the same bytes,
    tested), the reference's elementwise ops otherwise."""
    compiled = _cpu_extension(low_code.device)
    if compiled is None:
        levels = (1 << unpack_4bit(depths).long()) - 1
        return key_grid.ranges(low_code, high_code, levels, origin, unit)
    low, step = compiled.grid_ranges(low_code, high_code, depths, origin.float(), unit.float())
    return low, step


def code_groups(
    tail: torch.Tensor,
    pad: int,
    groups: int,
    weights: torch.Tensor | None,
    total: int,
    clip_range: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    at: int,
    grid: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`reference.code_groups` (the adaptive keys' coding of complete groups, written into their storage's rows),
    dispatched: one Triton launch on GPUs; elsewhere the reference with the depths, ranges and planes of
    `allocate_depths`, `clipped_codes` and `pack_planes` (C++ on the CPU). The same bytes (tested). `grid` (origin,
    unit: `key_grid`): the ranges on that grid, `out` holding their codes; the candidates are rounded onto it by the
    reference (`key_grid.clipped_codes`) and searched by `best_candidate` (C++ on the CPU; the reference elsewhere,
    GPUs included: no Triton kernel codes the grid yet)."""
    if grid is not None:
        clip = functools.partial(key_grid.clipped_codes, origin=grid[0], unit=grid[1], search=best_candidate)
        chunked = _cpu_extension(tail.device) is None  # (the reference's search keeps every candidate; C++ none)
        return reference.code_groups(
            tail, pad, groups, weights, total, clip_range, out, at, allocate_depths, pack_planes, clip, chunked
        )
    if use_triton(tail.device):
        from .triton.adaptive_code import code_groups as kernel
        from .triton.adaptive_code import serves

        if serves(tail.shape[-1], out[0].shape[-1] * 8) and all(t.stride(-1) == 1 for t in out):
            return kernel(tail, pad, groups, weights, total, clip_range, out, at)
    reference.code_groups(
        tail, pad, groups, weights, total, clip_range, out, at, allocate_depths, pack_planes, clipped_codes
    )


def code_delta(x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor, fmt: str, intra: bool):
    """`reference.code_delta` (one closed-loop step of the delta codec), dispatched like `quantize` on the CPU."""
    compiled = _cpu_extension(x.device) if _encodes(fmt, x.shape[-1]) else None
    if compiled is not None:
        from .cpu.encode import code_delta as kernel

        return kernel(x, base, long_term, fmt, intra, compiled)
    return reference.code_delta(x, base, long_term, fmt, intra)


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: StreamLayout,
    values: StreamLayout,
    *,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
) -> torch.Tensor:
    """`reference.stream_attention` (attention read straight from a cache layer's packed storage), dispatched; `query`
    may also be `[batch, kv_heads, group, n_queries, dim]` (transformers' queries as a view: the Triton kernels read
    them through their strides).

    On the CPU the compiled C++ kernel (`cpu/stream_attention.cpp`) serves plain and delta streams in q4_0, q4_1, q8_0,
    f16 and their 16-wide variants, rotated or not, keys and values of one width. On CUDA/ROCm the Triton kernels
    `triton/adaptive_attention.py` over adaptive keys and plain values, `triton/decode_attention.py` over plain keys
    and values (every format, rotated or not, keys before RoPE or after; sinks merged in the kernel), both for one
    query per head or a chunk of up to 64, and `triton/delta_attention.py` over delta keys and plain values (one
    query). Anything else goes to the chunked reference.
    """
    options = dict(rope=rope, mask=mask, n_queries=n_queries, causal_offset=causal_offset, scale=scale)
    if use_triton(query.device):
        from .triton import stream_attention as triton_attention

        out = triton_attention(query, sink_keys, sink_values, keys, values, **options)
        if out is not None:
            return out
    if query.dim() == 5:  # (the other paths read rows: a copy where transformers' layout is not theirs)
        query = query.flatten(2, 3)
    dim, value_dim = query.shape[-1], sink_values.shape[-1]
    if value_dim == dim and dim in CPU_HEAD_DIMS:
        compiled = _cpu_extension(query.device)
        if compiled is not None:
            from .cpu.stream_attention import stream_attention as kernel
            from .cpu.stream_attention import supports

            if supports(keys, values):
                cpu_options = {**options, "rope": _rope_arguments(rope, query.new_empty(0))}
                return kernel(query, sink_keys, sink_values, keys, values, **cpu_options, extension=compiled)
    return reference.stream_attention(query, sink_keys, sink_values, keys, values, **options)


def keep_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    target: KeptStream,
    at: int,
    position: int,
    pending: torch.Tensor | None = None,
) -> None:
    """`reference.keep_rows` (an evicting cache's new tokens written into their slots), dispatched: one Triton launch
    on GPUs, the reference elsewhere. The same bytes (tested)."""
    if use_triton(keys.device):
        from .triton.kept import keep_rows as kernel
        from .triton.kept import serves

        if serves(target.keys, target.values) and target.index.stride(-1) == 1:
            return kernel(keys, values, target, at, position, pending)
    reference.keep_rows(keys, values, target, at, position, pending)


def compact_kept(kept: KeptStream, pending: torch.Tensor | None, target: KeptStream) -> None:
    """`reference.compact_kept` (an evicting cache's kept tokens, in order, into new storage), dispatched: one Triton
    launch on GPUs for a step's few pending slots (a token's or a chunk's), the reference otherwise. The same bytes
    (tested)."""
    if use_triton(kept.keys.device) and (pending is None or pending.shape[2] <= 64):
        from .triton.kept import compact_kept as kernel
        from .triton.kept import serves

        if serves(kept.keys, kept.values) and serves(target.keys, target.values) and kept.index.stride(-1) == 1:
            return kernel(kept, pending, target)
    reference.compact_kept(kept, pending, target)


def kept_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    kept: KeptStream,
    mask: torch.Tensor | None,
    scale: float,
    query_position: int,
    observe_from: int | None,
) -> tuple[torch.Tensor, torch.Tensor | Observation | None]:
    """`reference.kept_attention` (attention over an evicting cache's sinks and kept tokens, and what SnapKV observes
    of it), dispatched: on GPUs by the Triton kernels, one query per head or a chunk of up to 64 (two launches; the
    observation is then the kernel's `Observation`, which `snapkv_evicted` reads), the reference otherwise."""
    batch, q_heads, n, dim = query.shape
    heads = kept.keys.shape[1]
    if use_triton(query.device) and q_heads % heads == 0 and (mask is None or mask.shape[1] == 1):
        from .triton.kept import kept_attention as kernel
        from .triton.kept import supports

        rows = None if mask is None else mask[:, 0]
        if supports(kept, rows, n):
            grouped = query.unflatten(1, (heads, q_heads // heads))  # [B, kv heads, group, n, D]: a view
            out, observed = kernel(grouped, sink_keys, sink_values, kept, rows, scale, observe_from, n,
                                   query_position)  # fmt: skip
            return out.view(batch, q_heads, n, dim), observed
    return reference.kept_attention(query, sink_keys, sink_values, kept, mask, scale, query_position, observe_from)


def snapkv_evicted(
    kept: KeptStream, observed: torch.Tensor | Observation, drop: int, recent: int, kernel: int
) -> torch.Tensor:
    """`reference.snapkv_evicted` (the slots SnapKV evicts), dispatched: the Triton kernel (one launch) from the
    attention kernel's `Observation` for a step's few slots (a token's or a chunk's; more: the reference's sort), the
    reference otherwise. The same slots (tested)."""
    if isinstance(observed, Observation) and drop <= 64 and use_triton(observed.scores.device):
        from .triton.kept import snapkv_evicted as evicted

        if kept.index.stride(-1) == 1:
            return evicted(kept, observed, drop, recent, kernel)
    return reference.snapkv_evicted(kept, observed, drop, recent, kernel)


def dequantize_latent(
    packed: torch.Tensor, scales: torch.Tensor, bits: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """`reference.dequantize_latent` (residual reconstruction: packed groups to the latent), dispatched: the Triton
    kernel on GPUs, the C++ kernel on the CPU; the same values on every path (tested). `out` (fp32, or bf16: each
    value rounded from the fp32 one; its leading dimensions may be the packed rows' flattened), when given, receives the
    latent and is returned."""
    if out is not None and (out.dtype not in (torch.float32, torch.bfloat16) or out.shape[-1] != len(bits) * GROUP):
        raise ValueError(f"out must be float32 or bfloat16 [..., {len(bits) * GROUP}], got {out.dtype} {out.shape}")
    triton = use_triton(packed.device)
    compiled = None if triton else _cpu_extension(packed.device)
    if compiled is None:
        if triton:
            from .triton.latent import dequantize_latent as kernel
        else:
            kernel = reference.dequantize_latent
        latent = kernel(packed, scales, bits)
        return latent if out is None else out.copy_(latent.reshape(out.shape))  # `out` may flatten the leading dims
    lead = packed.shape[:-1]
    flat_packed, flat_scales = packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, scales.shape[-1])
    flat_out = _NONE if out is None else out.view(-1, out.shape[-1])
    rows = compiled.dequantize_latent(flat_packed, flat_scales, bits, flat_out)
    return rows.view(*lead, rows.shape[-1]) if out is None else out


def quantize_latent(latent: torch.Tensor, bits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_latent` (the residual cache's encoding), dispatched: the C++ kernel on the CPU for finite
    fp32 latents (the same bytes, tested), the reference otherwise."""
    compiled = _cpu_extension(latent.device)
    if compiled is None or latent.dtype != torch.float32 or not bool(torch.isfinite(latent).all()):
        return reference.quantize_latent(latent, bits)  # non-finite values: the reference's NaN/inf rules
    lead = latent.shape[:-1]
    packed, scales = compiled.quantize_latent(latent.reshape(-1, latent.shape[-1]).contiguous(), bits)
    return packed.view(*lead, packed.shape[-1]), scales.view(*lead, scales.shape[-1])


def latent_attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    rope: RopeAngles | None,
    allowed: torch.Tensor | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: list[int],
    scale: float,
    key_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.latent_attention` (the residual cache's decode attention over one chunk), dispatched: the C++
    kernel on the CPU (fp32 rounding apart, the same statistics; tested), the reference elsewhere."""
    compiled = _cpu_extension(rows.device)
    if compiled is None:
        return reference.latent_attention(rows, keys, rope, allowed, codes, scales, bits, scale, key_mean)
    empty = rows.new_empty(0)
    maximum, weight, acc = compiled.latent_attention(
        rows.float(),
        keys if keys.dtype == torch.bfloat16 else keys.float(),
        empty if key_mean is None else key_mean.float(),
        *_rope_arguments(rope, rows.new_empty(0)),
        empty if allowed is None else allowed,
        codes,
        scales,
        bits,
        scale,
    )
    return maximum, weight, acc


def write_raw(
    keys: torch.Tensor, values: torch.Tensor, key_target: torch.Tensor, value_target: torch.Tensor, at: int
) -> None:
    """`reference.write_raw` (raw tokens into storage with room, in its dtype), dispatched: one Triton launch for keys
    and values on GPUs, the reference otherwise. The same bytes (tested)."""
    if use_triton(keys.device):
        from .triton.residual import serves_raw
        from .triton.residual import write_raw as kernel

        if serves_raw(keys, values, key_target) and key_target.dtype == value_target.dtype:
            return kernel(keys, values, key_target, value_target, at)
    reference.write_raw(keys, values, key_target, value_target, at)


def encode_latent_into(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor | None,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    coder: LatentCoder,
    bits: tuple[int, ...],
    target: LatentStream,
    at: int,
) -> None:
    """`reference.encode_latent_into` (the residual cache's coding of tokens into storage with room), dispatched: one
    Triton launch on GPUs; elsewhere the reference through the dispatched `undo_rope` and `quantize_latent` (C++ on the
    CPU)."""
    if use_triton(keys.device):
        from .triton.residual import encode_latent_into as kernel
        from .triton.residual import serves_encode

        if serves_encode(keys, target):
            return kernel(keys, values, positions, freqs, order, coder, bits, target, at)
    reference.encode_latent_into(keys, values, positions, freqs, order, coder, bits, target, at, undo_rope,
                                 quantize_latent)  # fmt: skip


def latent_stream_attention(
    query: torch.Tensor,
    raw: list[tuple[torch.Tensor, torch.Tensor, int]],
    stream: LatentStream,
    coder: LatentCoder,
    rope: RopeAngles | None,
    order: torch.Tensor | None,
    coded_column: int,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
) -> torch.Tensor | None:
    """`reference.latent_stream_attention` (attention over a residual layer's raw and coded tokens), on GPUs: two
    Triton launches for one query per head or a chunk of up to 64 (`raw`: the sinks, then the window); None elsewhere
    (the layer's own chunked path runs)."""
    if not use_triton(query.device) or len(raw) != 2:
        return None
    from .triton.residual import latent_stream_attention as kernel
    from .triton.residual import supports

    if not supports(query, stream, raw, mask, n_queries):
        return None
    return kernel(query, raw, stream, coder, rope, order, coded_column, mask, scale, n_queries, causal_offset)


def _rope_arguments(rope: RopeAngles | None, empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, freqs) as the C++ kernels take them: int32 rows, contiguous float64 frequencies; empty: no RoPE."""
    if rope is None:
        return empty, empty
    positions = rope.positions.to(torch.int32)
    positions = positions if positions.stride(-1) == 1 else positions.contiguous()
    return positions, rope.freqs.to(dtype=torch.float64, device=positions.device).contiguous()


def delta_encode_groups(
    x: torch.Tensor, long_term: torch.Tensor | None, keyframes: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.delta_encode_groups` (closed-loop delta coding of whole keyframe groups), dispatched."""
    if use_triton(x.device):
        from .triton.delta_encode import delta_encode_groups as kernel

        return kernel(x, long_term, keyframes, block)
    return reference.delta_encode_groups(x, long_term, keyframes, block)


def delta_tokens(
    x: torch.Tensor,
    turn: tuple | None,
    rotation: int,
    reference_state: torch.Tensor,
    running_sum: torch.Tensor | None,
    long_term: torch.Tensor | None,
    rows: DeltaRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.delta_tokens` (new tokens of the token-delta codec: RoPE undone, rotated, coded one after the other
    with their running mean into storage with room), dispatched: one Triton launch on GPUs (q8_0 keyframes, q4_0
    deltas of 16 or 32 channels); elsewhere the reference through the dispatched `undo_rope`, `quantize` and
    `code_delta` (C++ on the CPU). The same bytes (tested)."""
    dim = x.shape[-1]
    if use_triton(x.device) and dim >= 32 and not dim & (dim - 1) and x.stride(-1) == 1:
        from .triton.delta_encode import delta_tokens as kernel
        from .triton.delta_encode import serves

        if serves(rows) and all(_rows_contiguous(t) for t in (rows.keyframes, rows.deltas) if t is not None):
            return kernel(x, turn, rotation, reference_state, running_sum, long_term, rows)
    return reference.delta_tokens(x, turn, rotation, reference_state, running_sum, long_term, rows, undo_rope,
                                  quantize, code_delta)  # fmt: skip


_SPARSE_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)  # weight dtypes of the C++ sparse_matvec
_NONE = torch.empty(0)  # the C++ kernels' "no tensor"


def sparse_matvec(
    x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None, threshold: float
) -> tuple[torch.Tensor, int]:
    """`reference.sparse_matvec` (weight skip's decode linear), dispatched: the C++ kernel on the CPU (fp32, bf16 and
    fp16 weights stored contiguous), the Triton kernel on GPUs; both read only the kept rows of the input-major
    weight. Kernels do not record autograd: with gradients needed, the reference runs."""
    kernel = sparse_matvec_kernel(x.device)
    if kernel is None or (torch.is_grad_enabled() and (x.requires_grad or wt.requires_grad)):
        return reference.sparse_matvec(x, wt, bias, scale, threshold)
    return kernel(x, wt, bias, None if scale is None else scale.float().contiguous(), float(threshold))


def sparse_matvec_kernel(device: torch.device):
    """The kernel `sparse_matvec` runs on `device` as a function of the same arguments (None: the reference), for
    callers that resolve it once: weight skip runs it ~200 times per decoded token, where every microsecond shows.
    Kernels do not record autograd; `scale` must be fp32 and contiguous, `threshold` a float."""
    if use_triton(device):
        from .triton.sparse_matvec import sparse_matvec as kernel

        return kernel
    compiled = _cpu_extension(torch.device(device))
    if compiled is None:
        return None

    def cpu_kernel(x, wt, bias, scale, threshold):
        if wt.dtype not in _SPARSE_WEIGHTS or not wt.is_contiguous():
            return reference.sparse_matvec(x, wt, bias, scale, threshold)
        bias = _NONE if bias is None else bias
        scale = _NONE if scale is None else scale
        return compiled.sparse_matvec(x, wt, bias, scale, threshold)

    return cpu_kernel
