"""C++ kernels for the CPU, compiled on first use with `torch.utils.cpp_extension` (needs a C++ compiler and ninja).

Why C++ here and not PyTorch: a decode step through a compressed cache is dozens of small elementwise passes over
the whole history in eager PyTorch, each writing a full-precision temporary; one fused loop reads each packed byte
once and keeps every intermediate in registers and a few kilobytes of scratch. When the build is impossible (no
compiler) the callers fall back to the PyTorch reference, with one warning.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

SOURCES = [Path(__file__).with_name(name) for name in ("stream_attention.cpp", "encode.cpp", "module.cpp")]


@functools.cache
def extension():
    """The compiled module, or None when it cannot be built here (warns once)."""
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="hf_deltakv_cpu",
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # compiler, ninja or headers missing: the reference still works
        warnings.warn(
            f"hf_deltakv: the CPU attention kernel could not be built ({type(error).__name__}: {error}); "
            "using the slower PyTorch reference. Install a C++ compiler and `pip install ninja` to enable it.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
