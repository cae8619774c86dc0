"""One dispatch point for compute kernels.

Every op currently runs its PyTorch reference (`reference.py`), on any device. Triton kernels for CUDA and ROCm
devices are to be registered here, behind the same signatures, so that callers never change.
"""

from __future__ import annotations

from . import reference
from .reference import segmented_prefix_sum

__all__ = ["reference", "segmented_prefix_sum"]
