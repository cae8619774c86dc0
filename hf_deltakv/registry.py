"""One registry of caches: the CLI choices, the benchmark tables and the test matrix all come from here.

A spec is a name with optional parameters, e.g. `delta`, `delta:kf=64`, `q4_0`, `delta:values=q4_1,intra=false`; a
parameter taking a list (one entry per layer) is written with `/` between its entries: `delta:values=q3_0/q4_0`.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from .cache import DeltaKVCache, KIVIKVCache, QuantizedKVCache, SnapKVCache, StreamingLLMCache
from .residual.cache import ResidualKVCache


def hf_quantized_cache(backend: str, model: nn.Module | None = None, nbits: int = 4, **kwargs) -> Cache:
    """transformers' own `QuantizedCache` (KIVI-like, `residual_length` recent tokens kept in full precision),
    as an anchor measured under the same protocols as ours."""
    from transformers import QuantizedCache

    if model is None:
        raise ValueError(f"hf-{backend} needs the model (its config sizes the cache)")
    return QuantizedCache(backend, model.config, nbits=nbits, **kwargs)


@dataclass(frozen=True)
class CacheEntry:
    """A named cache: how to build it, the defaults of the name, whether it is handed the model, and the module
    it needs beyond our own dependencies (an optional extra)."""

    description: str
    cls: Callable[..., Cache]
    defaults: dict = field(default_factory=dict)
    takes_model: bool = False
    requires: str | None = None

    def available(self) -> bool:
        """False when the optional package this cache needs is not installed."""
        if self.requires is None:
            return True
        try:
            return importlib.util.find_spec(self.requires) is not None
        except ModuleNotFoundError:
            return False


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
    "delta-no-model": CacheEntry(
        "DeltaKVCache(kf=32) as the one-liner writes it: no model=, keys after RoPE", DeltaKVCache
    ),
    "streaming-llm": CacheEntry(
        "eviction baseline: StreamingLLM, 4 sink tokens + the most recent, 30 % of the tokens kept in fp16",
        StreamingLLMCache,
        takes_model=True,
    ),
    "snapkv": CacheEntry(
        "eviction baseline: SnapKV-style, per head the most attended tokens + the 32 most recent, 30 % kept in fp16",
        SnapKVCache,
        takes_model=True,
    ),
    "residual": CacheEntry(
        "ResidualKVCache (learned residual codes; built-in compressor for SmolLM2-135M, or compressor=DIR)",
        ResidualKVCache,
        takes_model=True,
    ),
    "hf-quanto": CacheEntry(
        "transformers QuantizedCache, optimum-quanto backend, 4 bits, 128 recent tokens in full precision",
        partial(hf_quantized_cache, "quanto"),
        takes_model=True,
        requires="optimum.quanto",
    ),
    "hf-hqq": CacheEntry(
        "transformers QuantizedCache, HQQ backend, 4 bits, 128 recent tokens in full precision",
        partial(hf_quantized_cache, "hqq"),
        takes_model=True,
        requires="hqq",
    ),
}


TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _parameter_types(entry: CacheEntry) -> dict[str, str]:
    """The annotation of each parameter of the entry's constructor, as written (`"bool"`, `"int | None"`, ...)."""
    target = entry.cls.func if isinstance(entry.cls, partial) else entry.cls
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    return {name: str(p.annotation) for name, p in parameters.items() if p.annotation is not inspect.Parameter.empty}


def _parse_value(text: str, annotation: str | None, key: str):
    """`text` as the parameter's annotated type: booleans strictly (true/false, yes/no, on/off, 1/0), numbers as
    numbers; without an annotation, the old guess (true/false, none, an integer, else the text)."""
    lowered = text.lower()
    if annotation is None:
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered == "none":
            return None
        try:
            return int(text)
        except ValueError:
            return text
    kinds = {part.strip() for part in annotation.split("|")}
    lists = [kind[len("list[") : -1] for kind in kinds if kind.startswith("list[")]
    if lists and "/" in text:  # one entry per layer: `q3_0/q4_0/...`
        return [_parse_value(part.strip(), lists[0], key) for part in text.split("/")]
    if "None" in kinds and lowered == "none":
        return None
    if "bool" in kinds:
        if lowered in TRUE or lowered in FALSE:
            return lowered in TRUE
        raise ValueError(f"cache parameter {key}={text!r}: expected true or false (yes/no, on/off, 1/0)")
    for kind, convert in (("int", int), ("float", float)):
        if kind in kinds:
            try:
                return convert(text)
            except ValueError:
                if kinds <= {kind, "None"}:
                    raise ValueError(f"cache parameter {key}={text!r}: expected {kind}") from None
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """`"delta:kf=64,values=q4_1"` -> `("delta", {"kf": 64, "values": "q4_1"})`; values take the type the cache's
    constructor declares for them."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a cache spec must be a non-empty name such as 'delta', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; allowed: {sorted(CACHES)}")
    types = _parameter_types(CACHES[name])
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"cache parameter {item!r} in {spec!r} is not of the form key=value")
        params[key] = _parse_value(value.strip(), types.get(key), key)
    return name, params


def build_cache(spec: str, model: nn.Module | None = None) -> Cache:
    """A fresh cache for `spec` (see module docstring), for `model`."""
    name, params = parse_spec(spec)
    entry = CACHES[name]
    if not entry.available():
        raise ImportError(f"cache {name!r} needs the {entry.requires!r} package: pip install 'hf-deltakv[anchors]'")
    kwargs = {**entry.defaults, **params}
    if entry.takes_model:
        kwargs.setdefault("model", model)
    try:
        return entry.cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"bad parameters for cache {name!r}: {err}") from err
