"""One dispatch point for compute kernels.

`use_triton(device)` decides: Triton on CUDA (NVIDIA, and AMD through ROCm builds of PyTorch, which also report
`cuda` devices) when Triton is installed, the PyTorch reference (`reference.py`) everywhere else.
`HF_DELTAKV_KERNELS=reference` forces the reference on every device. Triton ops live one per file and are tested
against their reference under `TRITON_INTERPRET=1` on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from . import reference
from .reference import skip_matvec

__all__ = [
    "code_delta",
    "delta_encode_groups",
    "dequantize_latent",
    "quantize",
    "reference",
    "segmented_prefix_sum",
    "skip_matvec",
    "stream_attention",
    "triton_available",
    "use_triton",
]


@functools.cache
def triton_available() -> bool:
    """Triton is importable (looked up once: the dispatch runs on every decode step)."""
    return importlib.util.find_spec("triton") is not None


def forced_reference() -> bool:
    """`HF_DELTAKV_KERNELS=reference`: every op runs its PyTorch reference."""
    return os.environ.get("HF_DELTAKV_KERNELS", "").lower() == "reference"


def use_triton(device: torch.device | str) -> bool:
    """Whether ops on `device` run as Triton kernels (see module docstring)."""
    return not forced_reference() and torch.device(device).type == "cuda" and triton_available()


def _cpu_extension(device: torch.device):
    """The compiled CPU kernels when `device` is the CPU and they are built (or can be), else None."""
    if device.type != "cpu" or forced_reference():
        return None
    from .cpu import extension

    return extension()


def quantize(x: torch.Tensor, fmt: str):
    """Dispatching `reference.quantize` (block formats), meant for a few rows (one decoded token): the compiled CPU
    kernel on the CPU for the q4_0, q4_1 and q8_0 families, the reference otherwise."""
    from .cpu.encode import supports

    compiled = _cpu_extension(x.device) if supports(fmt, x.shape[-1]) else None
    if compiled is not None:
        from .cpu.encode import quantize as kernel

        return kernel(x, fmt, compiled)
    return reference.quantize(x, fmt)


def code_delta(x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor, fmt: str, intra: bool):
    """Dispatching `reference.code_delta` (one closed-loop step of the delta codec), like `quantize`."""
    from .cpu.encode import supports

    compiled = _cpu_extension(x.device) if supports(fmt, x.shape[-1]) else None
    if compiled is not None:
        from .cpu.encode import code_delta as kernel

        return kernel(x, base, long_term, fmt, intra, compiled)
    return reference.code_delta(x, base, long_term, fmt, intra)


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    key_codec,
    value_codec,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
) -> torch.Tensor:
    """Dispatching `reference.stream_attention` (attention read straight from a cache layer's packed storage).

    On the CPU the compiled C++ kernel (`cpu/stream_attention.cpp`) serves plain and delta storage in q4_0, q4_1,
    q8_0, f16 and their 16-wide variants, rotated or not, keys and values of one width. On CUDA/ROCm the Triton
    kernel `triton/delta_attention.py` serves one query per head over DeltaKVCache's layout (delta keys, plain
    values). Anything else, and every call when no kernel can run, goes to the chunked reference.
    """
    dim, value_dim = query.shape[-1], sink_values.shape[-1]
    if use_triton(query.device) and n_queries == 1:
        from .triton.delta_attention import plan

        layout = plan(key_codec, value_codec, dim)
        if layout is not None:
            return _triton_stream_attention(query, sink_keys, sink_values, layout, cos, sin, mask, causal_offset, scale)
    compiled = _cpu_extension(query.device) if value_dim == dim and dim in (32, 64, 128, 256) else None
    if compiled is not None:
        from ..codecs.layout import describe

        keys, values = describe(key_codec, dim), describe(value_codec, value_dim)
        if keys is not None and values is not None:
            from .cpu.stream_attention import stream_attention as kernel

            args = (cos, sin, mask, n_queries, causal_offset, scale, key_codec.length, compiled)
            return kernel(query, sink_keys, sink_values, keys, values, *args)
    return reference.stream_attention(
        query, sink_keys, sink_values, key_codec, value_codec, cos, sin, mask, n_queries, causal_offset, scale
    )


def _triton_stream_attention(query, sink_keys, sink_values, layout, cos, sin, mask, causal_offset, scale):
    """The Triton delta kernel over the stream, merged with the sinks by the reference's online softmax."""
    from ..attention.chunked import OnlineSoftmax
    from .triton.delta_attention import delta_attention

    keys, key_rotation, values, value_rotation = layout
    batch, heads, group, dim = query.shape
    sinks = sink_keys.shape[2]
    grouped = query.reshape(batch, heads * group, 1, dim)
    state = OnlineSoftmax(grouped, scale, mask[:, None] if mask is not None else None, causal_offset + 1)
    if sinks:
        state.add(sink_keys, sink_values)
    stream_mask = mask[:, 0] if mask is not None else None
    acc, maximum, total = delta_attention(
        query, keys, values, key_rotation, value_rotation, cos, sin, stream_mask, sinks, scale
    )
    state.merge(acc[:, :, :, None], maximum[..., None], total[..., None])
    return state.result().reshape(batch, heads, group, dim)


def segmented_prefix_sum(values: torch.Tensor, resets: torch.Tensor, dim: int) -> torch.Tensor:
    """Dispatching `reference.segmented_prefix_sum` (delta decoding's running sum)."""
    if use_triton(values.device):
        from .triton.prefix_sum import segmented_prefix_sum as kernel

        return kernel(values, resets, dim)
    return reference.segmented_prefix_sum(values, resets, dim)


def dequantize_latent(packed: torch.Tensor, scales: torch.Tensor, bits: list[int]) -> torch.Tensor:
    """Dispatching `reference.dequantize_latent` (residual reconstruction: packed groups to the latent)."""
    if use_triton(packed.device):
        from .triton.latent import dequantize_latent as kernel

        return kernel(packed, scales, bits)
    return reference.dequantize_latent(packed, scales, bits)


def delta_encode_groups(
    x: torch.Tensor, long_term: torch.Tensor | None, keyframes: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatching `reference.delta_encode_groups` (closed-loop delta coding of whole keyframe groups)."""
    if use_triton(x.device):
        from .triton.delta_encode import delta_encode_groups as kernel

        return kernel(x, long_term, keyframes, block)
    return reference.delta_encode_groups(x, long_term, keyframes, block)
