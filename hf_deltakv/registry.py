"""One registry of caches: the CLI choices, the benchmark tables and the test matrix all come from here.

A spec is a name with optional parameters, e.g. `delta`, `delta:kf=64`, `q4_0`, `delta:values=q4_1,intra=false`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from .cache import DeltaKVCache, KIVIKVCache, QuantizedKVCache

CacheFactory = Callable[..., Cache]

# name -> (description, factory(model, **params))
CACHES: dict[str, tuple[str, CacheFactory]] = {
    "dynamic": ("transformers DynamicCache in the model's dtype (the reference)", lambda model: DynamicCache()),
    "fp16": ("fp16 storage, no quantization", lambda model, **kw: QuantizedKVCache("f16", "f16", **kw)),
    "q8_0": ("llama.cpp q8_0 keys and values", lambda model, **kw: QuantizedKVCache("q8_0", "q8_0", **kw)),
    "q4_0": ("llama.cpp q4_0 keys and values", lambda model, **kw: QuantizedKVCache("q4_0", "q4_0", **kw)),
    "q4_1": ("llama.cpp q4_1 keys and values", lambda model, **kw: QuantizedKVCache("q4_1", "q4_1", **kw)),
    "q4_0-rot": (
        "q4_0 after a Hadamard rotation of each head (current llama.cpp)",
        lambda model, **kw: QuantizedKVCache("q4_0", "q4_0", rotate=True, **kw),
    ),
    "kivi": (
        "KIVI-style: keys per channel over 32 tokens (q4_1), values per token (q4_1)",
        lambda model, **kw: KIVIKVCache(**kw),
    ),
    "kivi-pre-rope": (
        "KIVI-style with keys quantized before RoPE",
        lambda model, **kw: KIVIKVCache(model=model, pre_rope=True, **kw),
    ),
    "delta": ("DeltaKVCache (defaults; keys coded before RoPE)", lambda model, **kw: DeltaKVCache(model=model, **kw)),
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
    factory = CACHES[name][1]
    try:
        return factory(model, **params)
    except TypeError as err:
        raise ValueError(f"bad parameters for cache {name!r}: {err}") from err
