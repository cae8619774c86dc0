"""C++ kernels for the CPU, compiled on first use with `torch.utils.cpp_extension` (needs a C++ compiler and ninja).

Why C++ here and not PyTorch: a decode step through a compressed cache is dozens of small elementwise passes over
the whole history in eager PyTorch, each writing a full-precision temporary; one fused loop reads each packed byte
once and keeps every intermediate in registers and a few kilobytes of scratch. When the build is impossible (no
compiler) the callers fall back to the PyTorch reference, with one warning.
"""

from __future__ import annotations

import functools
import platform
import warnings
from pathlib import Path

SOURCES = [Path(__file__).with_name(name) for name in ("stream_attention.cpp", "encode.cpp", "module.cpp")]


def _flag_sets() -> list[tuple[list[str], list[str]]]:
    """Compiler and linker flags to try in turn: optimised for this CPU with OpenMP threads, then without OpenMP
    (compilers without it, such as Apple's clang), so the kernels still build, single-threaded. The integers the
    kernels switch on come from Python as `-D` definitions (part of the build's hash, so a change rebuilds)."""
    from ..layout import constants

    native = ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64") else []
    defines = [f"-D{name}={value}" for name, value in sorted(constants().items())]
    return [(["-O3", *native, "-fopenmp", *defines], ["-fopenmp"]), (["-O3", *native, *defines], [])]


@functools.cache
def extension():
    """The compiled module, or None when it cannot be built here (warns once)."""
    from torch.utils.cpp_extension import load

    errors = []
    for cflags, ldflags in _flag_sets():
        try:
            return load(
                name="hf_deltakv_cpu",
                sources=[str(source) for source in SOURCES],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                verbose=False,
            )
        except Exception as error:  # compiler, ninja or headers missing: the reference still works
            errors.append(f"{type(error).__name__}: {error}")
    warnings.warn(
        f"hf_deltakv: the CPU kernels could not be built ({errors[-1]}); using the slower PyTorch reference. "
        "Install a C++ compiler and `pip install ninja` to enable them.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None
