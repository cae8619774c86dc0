"""The folder layout is the architecture: imports between the package's top-level units point one way, down this
table (function-level imports count). A new unit must be placed here; docs/architecture.md draws the same picture."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_deltakv"

# Rank of every top-level unit: a unit may import only units of a lower rank.
RANKS = {
    "_compat": 0,  # what the installed libraries must offer (checked at import)
    "quant": 0,  # block formats as data, packing, reference quantizers, byte counting
    "rope": 0,  # undo/redo a model's RoPE
    "attention": 0,  # the glue between transformers' attention and a cache layer (duck-typed)
    "kernels": 1,  # references + C++ + Triton kernels over stream layouts; one dispatch point
    "persist": 1,  # files of caches and checkpoints: safetensors + JSON, model signatures, checked reads
    "codecs": 2,  # how one stream is encoded into packed storage
    "layers": 3,  # transformers cache layers over codecs
    "allocation": 3,  # DeltaKVCache(bits=): bits per layer from a shipped calibration (tables/*.json)
    "cache": 4,  # the Cache classes users construct
    "static": 5,  # caches for compiled decoding: storage preallocated to max_cache_len (layer types from `cache`)
    "eval": 5,  # perplexity/KL through a cache, texts, K/V statistics
    "weight_skip": 6,  # the decode-time linear hook (ops; eval's texts to calibrate on)
    "residual": 6,  # the learned residual cache as one feature (cache, layer, fitting, training, checkpoints)
    "registry": 7,  # one list of cache specs
    "compare": 8,  # side-by-side comparison of registry specs
    "models": 8,  # loading the embedded and other models
    "cli": 9,
    "calibrate": 9,  # measuring the sensitivities `allocation` spends bits by (through `compare`)
    "lm_eval": 9,
}


def _imports() -> dict[str, set[str]]:
    """Unit -> the other units it imports (every import statement, at any depth)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = parts[:-1] if parts[-1] == "__init__" else parts
        if len(module) < 2:
            continue
        unit = module[1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = list(module if parts[-1] == "__init__" else module[:-1])
                base = base[: len(base) - (node.level - 1)]
                targets = [base + (node.module.split(".") if node.module else [alias.name]) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [(node.module or "").split(".")]
            elif isinstance(node, ast.Import):
                targets = [alias.name.split(".") for alias in node.names]
            else:
                continue
            for target in targets:
                if len(target) > 1 and target[0] == "hf_deltakv" and target[1] != unit:
                    edges.setdefault(unit, set()).add(target[1])
    return edges


def test_every_unit_has_a_place():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    units -= {"__init__", "__pycache__"}
    assert units == set(RANKS), f"place these in RANKS: {sorted(units ^ set(RANKS))}"


def test_imports_point_down():
    upward = [
        f"{unit} -> {target}"
        for unit, targets in _imports().items()
        for target in targets
        if RANKS[target] >= RANKS[unit]
    ]
    assert not upward, "imports against the layering: " + ", ".join(sorted(upward))
