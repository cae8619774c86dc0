"""One registry of caches: the CLI choices, the benchmark tables and the test matrix all come from here.

A spec is a name with optional parameters, e.g. `delta`, `delta:kf=64`, `q4_0`, `delta:values=q4_1,intra=false`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from .cache import DeltaKVCache, KIVIKVCache, QuantizedKVCache


@dataclass(frozen=True)
class CacheEntry:
    """A named cache: its class, the defaults of the name, and whether it is handed the model."""

    description: str
    cls: type[Cache]
    defaults: dict = field(default_factory=dict)
    takes_model: bool = False


CACHES: dict[str, CacheEntry] = {
    "dynamic": CacheEntry("transformers DynamicCache in the model's dtype (the reference)", DynamicCache),
    "fp16": CacheEntry("fp16 storage, no quantization", QuantizedKVCache, {"k_format": "f16", "v_format": "f16"}),
    "q8_0": CacheEntry("llama.cpp q8_0 keys and values", QuantizedKVCache, {"k_format": "q8_0", "v_format": "q8_0"}),
    "q4_0": CacheEntry("llama.cpp q4_0 keys and values", QuantizedKVCache, {"k_format": "q4_0", "v_format": "q4_0"}),
    "q4_1": CacheEntry("llama.cpp q4_1 keys and values", QuantizedKVCache, {"k_format": "q4_1", "v_format": "q4_1"}),
    "q4_0-rot": CacheEntry(
        "q4_0 after a Hadamard rotation of each head (current llama.cpp)",
        QuantizedKVCache,
        {"k_format": "q4_0", "v_format": "q4_0", "rotate": True},
    ),
    "kivi": CacheEntry("KIVI-style: keys per channel over 32 tokens (q4_1), values per token (q4_1)", KIVIKVCache),
    "kivi-pre-rope": CacheEntry(
        "KIVI-style with keys quantized before RoPE", KIVIKVCache, {"pre_rope": True}, takes_model=True
    ),
    "delta": CacheEntry("DeltaKVCache (defaults; keys coded before RoPE)", DeltaKVCache, takes_model=True),
}


def _parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """`"delta:kf=64,values=q4_1"` -> `("delta", {"kf": 64, "values": "q4_1"})`."""
    name, _, rest = spec.partition(":")
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; allowed: {sorted(CACHES)}")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"cache parameter {item!r} in {spec!r} is not of the form key=value")
        params[key.strip()] = _parse_value(value.strip())
    return name, params


def build_cache(spec: str, model: nn.Module | None = None) -> Cache:
    """A fresh cache for `spec` (see module docstring), for `model`."""
    name, params = parse_spec(spec)
    entry = CACHES[name]
    kwargs = {**entry.defaults, **params}
    if entry.takes_model:
        kwargs.setdefault("model", model)
    try:
        return entry.cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"bad parameters for cache {name!r}: {err}") from err
