"""Where the benchmarks read their text and write their results, and how they count a cache's bytes (one place for
every script)."""

from __future__ import annotations

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
