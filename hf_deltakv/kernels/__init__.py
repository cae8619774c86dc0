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
    "delta_encode_groups",
    "dequantize_latent",
    "reference",
    "segmented_prefix_sum",
    "skip_matvec",
    "triton_available",
    "use_triton",
]


@functools.cache
def triton_available() -> bool:
    """Triton is importable (looked up once: the dispatch runs on every decode step)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device | str) -> bool:
    """Whether ops on `device` run as Triton kernels (see module docstring)."""
    if os.environ.get("HF_DELTAKV_KERNELS", "").lower() == "reference":
        return False
    return torch.device(device).type == "cuda" and triton_available()


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
