"""Where the benchmarks read their text and write their results, and how they count a cache's bytes (one place for
every script)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WIKITEXT = HERE.parent.parent / "shared" / "data" / "wikitext-2"
WIKITEXT_TEST = WIKITEXT / "test.txt"
WIKITEXT_VALID = WIKITEXT / "valid.txt"


def reachable_bytes(cache) -> int:
    """Bytes of every storage reachable from `cache`, each once (tests/test_bytes.py's walk, which `nbytes()` is
    held to within 2 % there): measured on the benchmarks' real models and lengths too."""
    import sys

    sys.path.insert(0, str(HERE.parent))
    from tests.test_bytes import held_bytes

    return held_bytes(cache)


def cache_bytes(cache) -> int:
    """Bytes a cache holds: ours say it (`nbytes()`, held to `reachable_bytes`); transformers' caches are summed over
    the storage of every tensor their layers keep."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    from hf_deltakv.quant import nbytes_of

    return nbytes_of([vars(layer) for layer in cache.layers])


def fp16_bytes(cache) -> int:
    """A DynamicCache's bytes were it kept fp16: 2 per scalar it holds (sliding layers hold their window)."""
    return 2 * sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)


# CPU features that decide how fast the kernels and the model's matmuls run (AMX: bf16 matrix units)
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "asimd", "sve")


def machine() -> dict:
    """The machine a speed measurement ran on, for its JSON (speed depends on the CPU: without AMX bf16 matmuls are
    slow): the CPU's model name, which of `SPEED_FLAGS` it has, the cores and the threads torch uses."""
    import torch

    from hf_deltakv.kernels.cpu import cpu_info

    model, flags = cpu_info()
    return {"cpu": model, "flags": [f for f in SPEED_FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "arch": platform.machine()}  # fmt: skip
